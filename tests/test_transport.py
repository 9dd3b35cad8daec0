"""The transport in front of the routes (issue 43, items 4 and 6), against a real `python -m dspark.serve` process:
stalled connections are closed after the request-read time-out while requests keep working, connections beyond the
cap get an OpenAI-shaped 503, and large bodies are refused by bytes or by items while `/health` stays fast."""
from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving import start_server

READ_TIMEOUT, KEEP_ALIVE, MAX_CONN = 4, 2, 200
ARGS = ["--max-model-len", "128", "--kv-cache-memory-bytes", str(16 * 2**20), "--max-num-seqs", "4",
        "--num-speculative-tokens", "3", "--served-model-name", "tiny", "--request-read-timeout", str(READ_TIMEOUT),
        "--timeout-keep-alive", str(KEEP_ALIVE), "--max-connections", str(MAX_CONN)]


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    s = start_server(["--model", str(tiny_ckpt), *ARGS], tmp_path_factory.mktemp("transport"))
    yield s
    s.stop()


def addr(server):
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    "Whether the server closes `sock` within `within` seconds (whatever it sends before closing)."
    end = time.monotonic() + within
    while (left := end - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536): return True
        except (ConnectionResetError, BrokenPipeError): return True
        except TimeoutError: return False
    return False


def complete(server, prompt="Simple is"):
    return httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=60)


def test_stalled_connections_are_closed_and_requests_keep_working(server):
    a = addr(server)
    stalled = []
    for i in range(150):                     # silent; half a header; a whole header and half the body
        s = socket.create_connection(a)
        if i % 3 == 1: s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Ty")
        if i % 3 == 2: s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 1000\r\n\r\n{\"prompt\": \"a")
        stalled.append(s)
    t0 = time.monotonic()
    # the connection cap: beyond MAX_CONN open connections a new one is refused at once, in OpenAI's shape
    extra, answers = [], []
    for _ in range(MAX_CONN - 150 + 20):
        s = socket.create_connection(a); extra.append(s)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
    for s in extra:
        s.settimeout(10); answers.append(s.recv(65536))
    refused = [r for r in answers if r.startswith(b"HTTP/1.1 503")]
    assert refused and all(r.startswith(b"HTTP/1.1 200") for r in answers if r not in refused)
    assert all(json.loads(r.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 503 for r in refused)
    for s in extra: s.close()
    # normal requests keep working while the stalled connections are open
    assert complete(server).status_code == 200 and httpx.get(server.url + "/health").status_code == 200
    # and every stalled connection is closed by the server after the time-out
    left = [s for s in stalled if not closed_by_server(s, max(0.5, READ_TIMEOUT + 20 - (time.monotonic() - t0)))]
    assert not left, f"{len(left)} stalled connections still open"
    print(f"150 stalled connections closed within {time.monotonic() - t0:.1f} s; {len(refused)} refused over the cap")
    for s in stalled: s.close()
    # an idle keep-alive connection is closed after --timeout-keep-alive
    s = socket.create_connection(a)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"); s.settimeout(10)
    assert s.recv(65536).startswith(b"HTTP/1.1 200")
    assert closed_by_server(s, KEEP_ALIVE + 10)
    s.close()
    assert complete(server).status_code == 200


def refused_by_length(server, size: int) -> bytes:
    "A body announced at `size` bytes, one MiB of it sent: the server's answer."
    with socket.create_connection(addr(server)) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {size}\r\n\r\n".encode() + b"[" * 2**20)
        s.settimeout(30)
        out = b""
        while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk: break
            out += chunk
        return out


def test_large_bodies_are_refused_while_health_stays_fast(server):
    text = "Beautiful is better than ugly. " * 125_000                 # 3.9 MB, within the 4 MiB byte limit
    bodies = [({"prompt": text, "max_tokens": 1}, 400, "prompt"),
              ({"prompt": [[5]] * 600_000, "max_tokens": 1}, 400, "prompt"),
              ({"prompt": [5] * 500_000, "max_tokens": 1}, 400, "prompt"),
              ({"prompt": "a", "stop": ["x"] * 350_000, "max_tokens": 1}, 400, "stop")]
    encoded = [json.dumps(b).encode() for b, _, _ in bodies]
    done, lat = threading.Event(), []
    client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=32))   # no client set-up in a probe's time

    def probe(sent: float):
        "A /health probe's status and its latency counted from when it was due (a client arriving then waits that long)."
        r = client.get(server.url + "/health")
        return r.status_code, time.perf_counter() - sent

    def big():
        try:
            for _ in range(2):
                for raw, (_, status, param) in zip(encoded, bodies):
                    r = client.post(server.url + "/v1/completions", content=raw,
                                   headers={"Content-Type": "application/json"}, timeout=60)
                    err = r.json()["error"]
                    assert (r.status_code, err["code"], err["param"]) == (status, status, param), r.text[:300]
                over = refused_by_length(server, 8 * 2**20)
                assert over.startswith(b"HTTP/1.1 413") and json.loads(over.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 413
        finally:
            done.set()

    with client, ThreadPoolExecutor(16) as pool:
        probe(time.perf_counter())                                       # a warm connection pool in the server
        sender = pool.submit(big)
        futures = []
        while not done.is_set():                                         # a probe due every 25 ms, whether or not
            futures.append(pool.submit(probe, time.perf_counter())); time.sleep(0.025)   # the last came back
        sender.result()
        lat = [f.result() for f in futures]
    assert lat and all(code == 200 for code, _ in lat)
    secs = sorted(t for _, t in lat)
    med = statistics.median(secs)
    print(f"/health while refusing large bodies: {len(secs)} probes, median {med * 1e3:.1f} ms, "
          f"p90 {secs[int(0.9 * len(secs))] * 1e3:.1f} ms, max {secs[-1] * 1e3:.1f} ms")
    assert med < 0.5                                  # generous: ~ms when the loop is free, seconds when it is not
    assert complete(server).status_code == 200
