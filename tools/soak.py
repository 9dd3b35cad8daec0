"""A bounded soak of a live server: many concurrent streaming clients, some hanging up mid-stream.

Checks what a long-running deployment depends on: no 5xx, every KV block back in the free pools once the
load stops (an aborted stream must not leak), resident memory flat after warm-up. Reports requests/s and
TTFT percentiles. With no --url it starts `python -m dspark.serve` on a tiny random checkpoint:

    python tools/soak.py --clients 64 --duration 60 --disconnect 0.1 [--url http://127.0.0.1:8000] [--json OUT]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from serving import start_server  # noqa: E402

from dspark.engine.metrics import scrape  # noqa: E402

PROMPTS = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "def fibonacci(n):",
           "import os\nimport sys\n", "Simple is better than complex. Complex is", "class Node:\n    def __init__(self"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"): return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def free_blocks(url: str) -> dict[str, float]:
    m = scrape(httpx.get(url + "/metrics", timeout=30).text)
    return {k: v for k, v in m.items() if k.startswith("dspark:kv_cache_free_blocks")} | \
           {"running": m.get("vllm:num_requests_running", -1), "waiting": m.get("vllm:num_requests_waiting", -1)}


def wait_idle(url: str, timeout: float = 120) -> dict[str, float]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        fb = free_blocks(url)
        if fb["running"] == 0 and fb["waiting"] == 0: return fb
        time.sleep(0.2)
    raise RuntimeError("server did not go idle after the soak")


async def one_request(c: httpx.AsyncClient, url: str, rng: random.Random, hang_up: bool, stats: dict) -> None:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(8, 48), "temperature": rng.choice([0.0, 1.0]),
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    try:
        async with c.stream("POST", url + "/v1/completions", json=body) as r:
            stats["status"][r.status_code] = stats["status"].get(r.status_code, 0) + 1
            if r.status_code != 200:
                await r.aread(); return
            first = True
            async for line in r.aiter_lines():
                if not line.startswith("data: {"): continue
                if first and json.loads(line[6:]).get("choices"):
                    stats["ttft"].append(time.perf_counter() - t0); first = False
                    if hang_up: stats["disconnected"] += 1; return          # leave mid-stream
            stats["completed"] += 1
    except httpx.HTTPError as e:
        stats["errors"].append(repr(e))


async def soak(url: str, clients: int, duration: float, disconnect: float, pid: int | None, seed: int = 0) -> dict:
    stats = {"status": {}, "ttft": [], "completed": 0, "disconnected": 0, "errors": [], "rss_kib": []}
    before = wait_idle(url)
    deadline = time.monotonic() + duration
    async def client(i):
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300)) as c:
            while time.monotonic() < deadline:
                await one_request(c, url, rng, rng.random() < disconnect, stats)
    async def sample_rss():
        while pid and time.monotonic() < deadline:
            stats["rss_kib"].append(rss_kib(pid)); await asyncio.sleep(1.0)
    t0 = time.monotonic()
    await asyncio.gather(sample_rss(), *(client(i) for i in range(clients)))
    wall = time.monotonic() - t0
    after = wait_idle(url)
    ttft = sorted(stats["ttft"])
    q = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))] if ttft else float("nan")
    rss = stats["rss_kib"]
    third = rss[len(rss) // 3] if rss else 0
    return {"clients": clients, "duration_s": round(wall, 1), "requests": sum(stats["status"].values()),
            "completed": stats["completed"], "disconnected": stats["disconnected"],
            "status_counts": stats["status"], "server_errors_5xx": sum(n for s, n in stats["status"].items() if s >= 500),
            "client_errors": stats["errors"][:5], "num_client_errors": len(stats["errors"]),
            "requests_per_s": round(sum(stats["status"].values()) / wall, 2),
            "ttft_p50_s": round(q(0.50), 3), "ttft_p99_s": round(q(0.99), 3),
            "free_blocks_before": before, "free_blocks_after": after,
            "rss_mib_after_warmup": round(third / 1024, 1), "rss_mib_end": round(rss[-1] / 1024, 1) if rss else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url"); p.add_argument("--pid", type=int, help="server pid, for resident memory (local --url only)")
    p.add_argument("--clients", type=int, default=64); p.add_argument("--duration", type=float, default=60)
    p.add_argument("--disconnect", type=float, default=0.1); p.add_argument("--json")
    a = p.parse_args()
    server = None
    if a.url is None:
        import dspark
        ck = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), seed=0)
        server = start_server(["--model", str(ck), "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 2**20),
                               "--max-num-seqs", "16"], Path(tempfile.mkdtemp()))
        a.url, a.pid = server.url, server.proc.pid
    try:
        report = asyncio.run(soak(a.url, a.clients, a.duration, a.disconnect, a.pid))
    finally:
        if server: server.stop()
    print(json.dumps(report, indent=2))
    if a.json: Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
