"""The bounded soak (tools/soak.py) on CPU with the tiny model: 64 concurrent streaming clients for 60 s,
10% hanging up mid-stream — zero 5xx, every KV block back, resident memory flat after warm-up."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from serving import start_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from soak import soak  # noqa: E402


@pytest.mark.slow
def test_soak_64_streaming_clients(tiny_ckpt, tmp_path):
    s = start_server(["--model", str(tiny_ckpt), "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 2**20),
                      "--max-num-seqs", "16"], tmp_path)
    try:
        r = asyncio.run(soak(s.url, clients=64, duration=60, disconnect=0.1, pid=s.proc.pid))
    finally:
        s.stop()
    print(r)
    assert r["server_errors_5xx"] == 0 and r["num_client_errors"] == 0, r
    assert r["completed"] > 0 and r["disconnected"] > 0
    assert r["free_blocks_after"] == r["free_blocks_before"]
    assert r["rss_mib_end"] < 1.1 * r["rss_mib_after_warmup"] + 32, r
