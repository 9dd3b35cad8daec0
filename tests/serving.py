"""Start and stop a real `python -m dspark.serve` process on 127.0.0.1 for the server tests and the soak tool."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: Path

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=30).text

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try: self.proc.wait(timeout)
            except subprocess.TimeoutExpired: self.proc.kill(); self.proc.wait()
        return self.proc.returncode

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_server(args: list[str], log_dir: Path, env: dict | None = None, timeout: float = 180) -> Server:
    "Launch the server in its own process (one torch thread) and wait until /health answers 200."
    port = free_port()
    log = Path(log_dir) / f"server-{port}.log"
    e = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"} | (env or {})
    proc = subprocess.Popen([sys.executable, "-m", "dspark.serve", "--host", "127.0.0.1", "--port", str(port), *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=e, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200: return Server(proc, url, log)
        except httpx.HTTPError: pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server did not become healthy in {timeout} s:\n{log.read_text()}")
