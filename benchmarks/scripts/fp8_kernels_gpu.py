"""Chapter 18a's FP8 linears on the GPU, at every V4-Flash FP8 matrix (O x I) and 1, 16, 64, 256 and 4096 rows (bf16
activations): parity with `fp8_linear_ref` (max |y - ref| / max |ref|), device us per call (a CUDA graph of at
least 20 calls replayed, the weights rotated through enough copies that L2 cannot hold them: the decode case,
where each step reads each weight once from HBM), the weight stream in TB/s ((O*I + scale bytes) / time), TFLOP/s.
At up to 256 rows: the table's launch (`fp8_config`) and the best of every (tile, SPLIT_K) of `FP8_TILE_CHOICES` x
`FP8_SPLITS`; at every size: `fp8_linear` (the dispatcher), torch's blockwise `F.scaled_mm` (`fp8_linear_library`)
and bf16 `x @ w.T` on the dequantised weight. Then one layer's FP8 matrices in sequence in one graph at 1 and 16
rows, and a device-to-device copy as the bandwidth ceiling. Every case is guarded: a failure is recorded, not fatal.

    python benchmarks/scripts/fp8_kernels_gpu.py              # writes $OUT/fp8_kernels.json (OUT defaults to /tmp)
    python benchmarks/scripts/fp8_kernels_gpu.py --cpu-smoke  # tiny shapes on Triton's interpreter: catches Python errors
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from dspark.kernels.fp8 import (FP8_SPLITS, FP8_TILE_CHOICES, FP8Config, fp8_config, fp8_linear,  # noqa: E402
                                fp8_linear_library, fp8_linear_ref, fp8_linear_triton)

V4_FLASH = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_a": (8192, 4096),
            "wo_b": (4096, 8192), "shared.w1/w3": (2048, 4096), "shared.w2": (4096, 2048),
            "indexer.wq_b": (8192, 1024)}
LAYER = ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "shared.w1/w3", "shared.w1/w3", "shared.w2", "indexer.wq_b")
SMOKE = {"wq_a": (256, 512), "wkv": (200, 384)}


def graph_us(fns, reps: int = 5) -> float:
    """Device us per call of the callables `fns`, run in order: captured in one CUDA graph after a warm-up on a side
    stream (compiles, allocator), the graph replayed `reps` times between two events. Without CUDA: host time."""
    if not torch.cuda.is_available():
        for f in fns: f()
        t = time.perf_counter()
        for f in fns: f()
        return 1e6 * (time.perf_counter() - t) / len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns: f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns: f()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps): graph.replay()
    end.record()
    end.synchronize()
    us = 1000 * start.elapsed_time(end) / (reps * len(fns))
    del graph
    return us


def random_fp8(O: int, I: int, device, g) -> tuple[torch.Tensor, torch.Tensor]:
    "Codes of rms 64 and block scales around I^-1/2 / 64 (a few powers of two apart), as stored."
    w = (torch.randn(O, I, device=device, generator=g) * 64).clamp_(-448, 448).to(torch.float8_e4m3fn)
    e = round(math.log2(I ** -0.5 / 64)) + 127
    s = torch.randint(e - 2, e + 3, (-(-O // 128), -(-I // 128)), device=device, generator=g, dtype=torch.int32)
    return w, s.to(torch.uint8).view(torch.float8_e8m0fnu)


def dense_bf16(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    O, I = w.shape
    ws = torch.exp2(s.view(torch.uint8).float() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)[:O, :I]
    return (w.float() * ws).bfloat16()


def copies_for(nbytes: int, smoke: bool) -> int:
    "How many copies of a weight make the rotation twice the L2 (at most 64)."
    if smoke or not torch.cuda.is_available(): return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(1, min(64, math.ceil(2 * l2 / nbytes)))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-30)).item()


def measure(row: dict, key: str, fn_of_copy, copies: int, nbytes: int, flops: int) -> None:
    "Time `fn_of_copy(i)` over the rotation into `row[key]` (us, TB/s, TFLOP/s), or record the error."
    try:
        us = graph_us([(lambda i=i: fn_of_copy(i % copies)) for i in range(max(20, copies))])
        row[key] = {"us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3), "tflop_s": round(flops / us / 1e6, 2)}
    except Exception as e:                                       # one failing case must not end the run
        row[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def parity(row: dict, key: str, fn, ref) -> None:
    try: row[key] = round(rel_err(fn(), ref), 7)
    except Exception as e: row[key] = f"{type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (Triton's interpreter)")
    ap.add_argument("--budget-s", type=float, default=120.0, help="skip the remaining config sweeps past this time")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    device = "cpu" if smoke else "cuda"
    if not smoke and not torch.cuda.is_available(): sys.exit("no CUDA device: pass --cpu-smoke to check the script")
    t0 = time.perf_counter()
    shapes = SMOKE if smoke else V4_FLASH
    Ms = (1, 16, 300) if smoke else (1, 16, 64, 256, 4096)
    tiles = FP8_TILE_CHOICES[:2] if smoke else FP8_TILE_CHOICES
    splits = FP8_SPLITS[:2] if smoke else FP8_SPLITS
    try: commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    except Exception: commit = ""
    res = {"script": "benchmarks/scripts/fp8_kernels_gpu.py", "command": " ".join(sys.argv), "commit": commit,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": torch.cuda.get_device_name() if not smoke else "cpu",
           "torch": torch.__version__, "triton": __import__("triton").__version__, "dtype": "bfloat16",
           "timing": "CUDA graph of max(20, copies) calls over a rotation of weight copies (2x L2), 5 replays",
           "rows": [], "layer": [], "copy": None}
    g = torch.Generator(device=device).manual_seed(0)
    weights, xs = {}, {}
    torch.set_grad_enabled(False)
    for name, (O, I) in shapes.items():
        w, s = random_fp8(O, I, device, g)
        nbytes = O * I + s.numel()
        n = copies_for(nbytes, smoke)
        wc = [w] + [w.clone() for _ in range(n - 1)]
        sc = [s] + [s.clone() for _ in range(n - 1)]
        weights[name] = (wc, sc)
        for M in Ms:
            row = {"matrix": name, "O": O, "I": I, "M": M, "copies": n}
            x = xs.setdefault((M, I), torch.randn(M, I, device=device, generator=g).bfloat16())
            flops = 2 * M * O * I
            try: ref = fp8_linear_ref(x, w, s)
            except Exception as e: ref, row["ref_error"] = None, f"{type(e).__name__}: {str(e)[:200]}"
            if ref is not None:
                parity(row, "rel_err_fp8_linear", lambda: fp8_linear(x, w, s), ref)
                parity(row, "rel_err_library", lambda: fp8_linear_library(x, w, s), ref)
            measure(row, "fp8_linear", lambda i: fp8_linear(x, wc[i], sc[i]), n, nbytes, flops)
            measure(row, "library", lambda i: fp8_linear_library(x, wc[i], sc[i]), n, nbytes, flops)
            if M <= 256:
                table = fp8_config(M, O, I, torch.cuda.get_device_properties(0).multi_processor_count if not smoke else 132)
                row["table_config"] = list(table)
                if ref is not None: parity(row, "rel_err_table", lambda: fp8_linear_triton(x, w, s, table), ref)
                measure(row, "table", lambda i: fp8_linear_triton(x, wc[i], sc[i], table), n, nbytes, flops)
                sweep, blocks = [], I // 128
                for bn, warps, stages in tiles:
                    for split in splits:
                        per = -(-blocks // split)
                        if split > blocks or -(-blocks // per) != split: continue   # the same launch as a smaller split
                        if time.perf_counter() - t0 > args.budget_s:
                            row["sweep_skipped"] = "time budget"; break
                        c = FP8Config(table.block_m, bn, split, warps, stages)
                        r = {"config": list(c)}
                        measure(r, "t", lambda i, c=c: fp8_linear_triton(x, wc[i], sc[i], c), n, nbytes, flops)
                        sweep.append({"config": list(c), **r["t"]})
                timed = [r for r in sweep if "us" in r]
                row["sweep_errors"] = [r for r in sweep if "error" in r][:3]
                if timed: row["best"] = min(timed, key=lambda r: r["us"])
            else:
                measure(row, "triton_large", lambda i: fp8_linear_triton(x, wc[i], sc[i], FP8Config(64, 128, 1, 4, 3)),
                        n, nbytes, flops)
            try:
                wd = dense_bf16(w, s)
                nd = copies_for(2 * O * I, smoke)
                dc = [wd] + [wd.clone() for _ in range(nd - 1)]
                measure(row, "bf16", lambda i: x @ dc[i].T, nd, 2 * O * I, flops)
                del dc, wd
            except Exception as e: row["bf16"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            del ref
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        if not smoke: torch.cuda.empty_cache()
    # one layer's FP8 matrices in sequence, one graph: the weight stream of a decode step's layer
    layer = [k for k in LAYER if k in weights]
    nbytes = sum(shapes[k][0] * shapes[k][1] + weights[k][1][0].numel() for k in layer)
    for M in (1, 16):
        row = {"M": M, "matrices": layer, "bytes": nbytes}
        for k in layer: xs.setdefault((M, shapes[k][1]), torch.randn(M, shapes[k][1], device=device, generator=g).bfloat16())
        for path, fn in (("fp8_linear", fp8_linear), ("library", fp8_linear_library)):
            try:
                calls = [(lambda k=k, fn=fn: fn(xs[M, shapes[k][1]], weights[k][0][0], weights[k][1][0])) for k in layer]
                us = graph_us(calls) * len(calls)
                row[path] = {"us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3)}
            except Exception as e: row[path] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["layer"].append(row)
        print(json.dumps(row), flush=True)
    # device-to-device copy: the bandwidth ceiling (read + write bytes)
    try:
        nb = (1 << 20) if smoke else (1 << 30)
        src, dst = torch.empty(nb, dtype=torch.uint8, device=device), torch.empty(nb, dtype=torch.uint8, device=device)
        us = graph_us([lambda: dst.copy_(src)] * 5)
        res["copy"] = {"bytes": nb, "us": round(us, 2), "tb_s_read_plus_write": round(2 * nb / us / 1e6, 3)}
    except Exception as e: res["copy"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    print(json.dumps({"copy": res["copy"]}), flush=True)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    out = os.environ.get("OUT", "/tmp")
    Path(out).mkdir(parents=True, exist_ok=True)
    json.dump(res, open(f"{out}/fp8_kernels.json", "w"), indent=1)
    print_table(res)
    print(f"wrote {out}/fp8_kernels.json in {res['wall_s']} s")


def print_table(res: dict) -> None:
    "One line per (matrix, M): us and TB/s of the table's launch, the best of the sweep, the dispatcher, the library, bf16."
    def cell(d):
        if not isinstance(d, dict): return "-"
        return f"{d['us']:.1f}us {d['tb_s']:.2f}TB/s" if "us" in d else "error"
    print(f"\n{'matrix':14s} {'M':>5s} {'rel err':>9s} | {'table':>20s} | {'best (config)':>38s} | {'fp8_linear':>20s} | "
          f"{'library':>20s} | {'bf16':>20s}")
    for r in res["rows"]:
        best = r.get("best")
        b = f"{cell(best)} {tuple(best['config'])}" if best else "-"
        err = r.get("rel_err_fp8_linear")
        err = f"{err:.2e}" if isinstance(err, float) else "error"
        print(f"{r['matrix']:14s} {r['M']:5d} {err:>9s} | {cell(r.get('table')):>20s} | {b:>38s} | "
              f"{cell(r.get('fp8_linear')):>20s} | {cell(r.get('library')):>20s} | {cell(r.get('bf16')):>20s}")
    for r in res["layer"]:
        print(f"layer M={r['M']}: {r['bytes'] / 1e6:.0f} MB of FP8 weights: fp8_linear {cell(r['fp8_linear'])}, "
              f"library {cell(r['library'])}")
    c = res["copy"] or {}
    if "us" in c: print(f"copy: {c['tb_s_read_plus_write']:.2f} TB/s (read + write)")


if __name__ == "__main__":
    main()
