"""Chapter 18b's FP4 MoE on the GPU at V4-Flash's expert shapes (D 4096, I 2048, 256 experts, top-6), random routing:
parity with `fp4_moe_ref` (max |y - ref| / max |ref|, on the first tokens at large N), µs a call (the two launches in
a replayed CUDA graph), for the grouped tensor-core path (the best of a few tiles) and the first CUDA-core kernel, TB/s of the selected experts' FP4
bytes (distinct experts hit x 3 matrices, codes and scales), TFLOP/s, the best of a few tiles; chapter 18's bf16
kernels on dense stacks of 32 experts and the FP4 kernel on the same 32 for comparison; a copy-bandwidth baseline.

    OUT=. python benchmarks/scripts/fp4_moe_gpu.py          # H100/H200, < 150 s; writes $OUT/fp4_moe.json
    python benchmarks/scripts/fp4_moe_gpu.py --cpu-smoke    # tiny shapes under Triton's interpreter: Python errors only
"""
import argparse, datetime, json, os, platform, sys, time, traceback

import torch

from dspark.kernels.fp4_moe import (FP4Stack, fp4_down, fp4_moe_grouped, fp4_moe_ref, fp4_moe_small, fp4_up)
from dspark.kernels.moe import small_moe_triton
from dspark.model.layers import StackedExperts, grouped_experts
from dspark.tools.records import git_commit
import triton

ap = argparse.ArgumentParser()
ap.add_argument("--cpu-smoke", action="store_true")
args = ap.parse_args()
SMOKE = args.cpu_smoke
dev = "cpu" if SMOKE else "cuda"
D, I, E, K = (256, 128, 8, 2) if SMOKE else (4096, 2048, 256, 6)
E_BF16 = 4 if SMOKE else 32
TOKENS = (1, 4) if SMOKE else (1, 16, 64, 256, 4096)
SMALL_MAX, REF_TOKENS = (4, 4) if SMOKE else (16, 8)
GROUPED_TILES = ((16, 64),) if SMOKE else ((16, 64), (16, 128), (32, 64), (64, 64), (64, 128))   # (block of pairs, BN down)
UP_TILES, DOWN_TILES = ((16,), (32,)) if SMOKE else ((8, 16, 32), (16, 32, 64))
LIMIT = 10.0
g = torch.Generator(device=dev).manual_seed(0)
rows, t_start = [], time.time()

def timed_us(fn, graph=True) -> float:
    "µs a call: a replayed CUDA graph (`do_bench_cudagraph`), eagerly for a path that reads the host; once on CPU."
    if SMOKE:
        t = time.perf_counter(); fn(); return 1e6 * (time.perf_counter() - t)
    if graph: return 1000 * triton.testing.do_bench_cudagraph(fn, rep=20)
    return 1000 * triton.testing.do_bench(fn, warmup=5, rep=40)

def case(name, fn):
    "Run one case; a failure is recorded, never fatal."
    try:
        row = {"case": name, **fn()}
    except Exception as e:
        row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:400]}"}
        traceback.print_exc(limit=2)
    rows.append(row); print(json.dumps(row), flush=True)
    if dev == "cuda": torch.cuda.empty_cache()

def fp4_stack(E):
    "Random FP4 experts: uniform codes, scale bytes around 2^-7 (weights of rms about 0.02)."
    code = lambda *s: torch.randint(-128, 128, s, device=dev, generator=g, dtype=torch.int8)
    scale = lambda *s: torch.randint(118, 122, s, device=dev, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return FP4Stack(code(E, 2 * I, D // 2), scale(E, 2 * I, D // 32), code(E, D, I // 2), scale(E, D, I // 32), ())

EXPERT_BYTES = 3 * I * D // 2 + 3 * I * D // 32          # codes and scales of w1, w3, w2

def routing(N, n_exp):
    idx = torch.rand(N, n_exp, device=dev, generator=g).argsort(-1)[:, :K]   # k distinct experts a token
    return torch.randn(N, D, device=dev, generator=g).bfloat16(), torch.rand(N, K, device=dev, generator=g), idx

def rel_err(y, ref) -> float:
    return ((y - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()

def stats(us, idx, bytes_per_expert=EXPERT_BYTES):
    hit = idx.unique().numel()
    return {"us": round(us, 2), "experts_hit": hit, "TB_s": round(hit * bytes_per_expert / us / 1e6, 3),
            "TFLOP_s": round(idx.numel() * 6 * D * I / us / 1e6, 3)}

def copy_baseline():
    n = (64 if SMOKE else 1 << 30)
    src, dst = torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev)
    us = timed_us(lambda: dst.copy_(src))
    return {"bytes": n, "us": round(us, 2), "TB_s": round(2 * n / us / 1e6, 3)}   # read + write

case("copy", copy_baseline)
st = fp4_stack(E)
for N in TOKENS:
    x, w, idx = routing(N, E)
    sub = slice(0, min(N, REF_TOKENS))
    ref = fp4_moe_ref(x[sub], w[sub], idx[sub], st, 0, LIMIT)
    if N <= SMALL_MAX:
        def small(N=N, x=x, w=w, idx=idx, ref=ref):
            h = fp4_up(x, w, idx, st, 0, LIMIT)
            up = {bi: timed_us(lambda: fp4_up(x, w, idx, st, 0, LIMIT, bi)) for bi in UP_TILES}
            down = {bd: timed_us(lambda: fp4_down(h, idx, st, 0, bd)) for bd in DOWN_TILES}
            bi, bd = min(up, key=up.get), min(down, key=down.get)
            us = timed_us(lambda: fp4_moe_small(x, w, idx, st, 0, LIMIT, bi, bd))
            err = rel_err(fp4_moe_small(x[sub], w[sub], idx[sub], st, 0, LIMIT, bi, bd), ref)
            return {"path": "fp4_small", "tokens": N, "pairs": N * K, "block_i": bi, "block_d": bd,
                    "up_us": {str(k): round(v, 2) for k, v in up.items()},
                    "down_us": {str(k): round(v, 2) for k, v in down.items()}, "max_rel_err": err, **stats(us, idx)}
        case(f"fp4_small N={N}", small)
    def grouped(N=N, x=x, w=w, idx=idx, ref=ref):
        tiles = [t for t in GROUPED_TILES if t[0] <= max(16, N * K // 8)]
        us = {t: timed_us(lambda: fp4_moe_grouped(x, w, idx, st, 0, LIMIT, *t)) for t in tiles}
        best = min(us, key=us.get)
        err = rel_err(fp4_moe_grouped(x[sub], w[sub], idx[sub], st, 0, LIMIT, *best), ref)
        return {"path": "fp4_grouped", "tokens": N, "pairs": N * K, "tile": list(best),
                "tiles_us": {str(k): round(v, 2) for k, v in us.items()}, "max_rel_err": err, **stats(us[best], idx)}
    case(f"fp4_grouped N={N}", grouped)
    del x, w, idx, ref

# the same kernel and chapter 18's bf16 kernels on 32 experts (256 bf16 experts would not fit): same routing
bf = {}
def dense_stacks():
    bf["st"] = StackedExperts((torch.randn(E_BF16, 2 * I, D, device=dev, generator=g) * D ** -0.5).bfloat16(),
                              (torch.randn(E_BF16, D, I, device=dev, generator=g) * I ** -0.5).bfloat16(), (),
                              torch.arange(E_BF16, device=dev))
    return {"experts": E_BF16, "bytes": 2 * 3 * I * D * E_BF16}
case("bf16 stacks", dense_stacks)
for N in TOKENS[:-1] if not SMOKE else TOKENS:
    x, w, idx = routing(N, E_BF16)
    case(f"fp4_grouped E={E_BF16} N={N}", lambda: {"path": "fp4_grouped_e32", "tokens": N, "pairs": N * K,
                                                  **stats(timed_us(lambda: fp4_moe_grouped(x, w, idx, st, 0, LIMIT)), idx)})
    if "st" in bf:
        sb = bf["st"]
        case(f"bf16_small E={E_BF16} N={N}", lambda: {"path": "bf16_small", "tokens": N, "pairs": N * K, **stats(
            timed_us(lambda: small_moe_triton(x, w, idx, sb.w13, sb.w2, 0, LIMIT)), idx, 2 * 3 * I * D)})
        case(f"bf16_grouped E={E_BF16} N={N}", lambda: {"path": "bf16_grouped", "tokens": N, "pairs": N * K, **stats(
            timed_us(lambda: grouped_experts(x, w, idx, sb, 0, LIMIT, whole=True)), idx, 2 * 3 * I * D)})

machine = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": triton.__version__}
record = {"commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "machine": machine, "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
          "config": {"D": D, "I": I, "experts": E, "k": K, "tokens": TOKENS, "smoke": SMOKE,
                     "seconds": round(time.time() - t_start, 1)}, "rows": rows}
out = os.environ.get("OUT", "/tmp")
json.dump(record, open(f"{out}/fp4_moe.json", "w"), indent=1)
print(f"\n{'case':28s} {'us':>10s} {'TB/s':>7s} {'TFLOP/s':>8s} {'rel err':>9s}")
for r in rows:
    err = r.get("max_rel_err")
    print(f"{r['case']:28s} {r.get('us', float('nan')):10.1f} {r.get('TB_s', float('nan')):7.3f} "
          f"{r.get('TFLOP_s', float('nan')):8.3f} {'' if err is None else f'{err:9.2e}'}{'  ' + r['error'] if 'error' in r else ''}")
print(f"wrote {out}/fp4_moe.json in {time.time() - t_start:.0f} s")
