"""Chapter 18c's grouped FP4 launches at prefill sizes (V4-Flash experts: D 4096, I 2048, 256 experts, top-6, random
routing): each launch's µs and TFLOP/s over its loop's form (JOIN: one product a 128-block on the activations'
contiguous tile; TILE_FIRST: the output tile numbered first), pair block, down tile, warps and stages, beside a
dense bf16 GEMM of the same FLOPs (what the tensor cores give without the FP4 decode). Every configuration's output
is compared with the shipped one's.

    OUT=. python benchmarks/scripts/fp4_grouped_gpu.py [--tokens 4096] [--budget 240]   # writes $OUT/fp4_grouped_<tokens>.json
"""
import argparse, itertools, json, os, sys, time, traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dspark.kernels import fp4_grouped as G
from dspark.kernels.fp4_moe import FP4Stack, act_rows

D, I, E, K, LIMIT = 4096, 2048, 256, 6, 10.0


def setup(N: int, g: torch.Generator):
    code = lambda *s: torch.randint(-128, 128, s, device="cuda", generator=g, dtype=torch.int8)
    scale = lambda *s: torch.randint(118, 122, s, device="cuda", generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    st = FP4Stack(code(E, 2 * I, D // 2), scale(E, 2 * I, D // 32), code(E, D, I // 2), scale(E, D, I // 32), ())
    x = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    idx = torch.rand(N, E, device="cuda", generator=g).argsort(-1)[:, :K]
    return x, torch.rand(N, K, device="cuda", generator=g), idx, st


def launches(x, w, idx, st, c: G.GroupedTiles):
    "The up and down launches of `fp4_moe_grouped` under `c`, as two callables on shared buffers, and the output."
    N, P = x.shape[0], idx.numel()
    rows, bexp = G._align(idx, 0, E, c.bm)
    xq, wt = act_rows(x).to(torch.bfloat16), w.reshape(-1).float()
    h = torch.empty(P, I, dtype=torch.bfloat16, device="cuda")
    y = torch.zeros(P, D, dtype=torch.float32, device="cuda")
    grid = lambda n, bn: (triton.cdiv(n, bn), bexp.numel()) if c.tile_first else (bexp.numel(), triton.cdiv(n, bn))
    up = lambda: G._fp4_grouped_kernel[grid(I, G.FP4_BN_UP)](
        xq, K, rows, bexp, wt, st.w13, st.s13.view(torch.uint8), h, D, I, I, LIMIT, UP=True, BM=c.bm, BN=G.FP4_BN_UP,
        F32=False, ASM=True, JOIN=c.join, TILE_FIRST=c.tile_first, num_warps=c.warps_up, num_stages=c.stages_up)
    down = lambda: G._fp4_grouped_kernel[grid(D, c.bn_down)](
        h, 1, rows, bexp, wt, st.w2, st.s2.view(torch.uint8), y, I, D, I, LIMIT, UP=False, BM=c.bm, BN=c.bn_down,
        F32=False, ASM=True, JOIN=c.join, TILE_FIRST=c.tile_first, num_warps=c.warps_down, num_stages=c.stages_down)
    return up, down, h, y


def main(a):
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tokens": a.tokens, "rows": []}
    path = Path(os.environ.get("OUT", "/tmp"), f"fp4_grouped_{a.tokens}.json")
    save = lambda: path.write_text(json.dumps(out, indent=1) + "\n")
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, idx, st = setup(a.tokens, g)
    P = idx.numel()
    flops_up, flops_down = 2 * P * D * 2 * I, 2 * P * I * D
    A, B = torch.randn(P, D, device="cuda").bfloat16(), torch.randn(2 * I, D, device="cuda").bfloat16()
    dense = triton.testing.do_bench(lambda: A @ B.T, rep=100)
    out["dense_bf16_up_shape"] = {"us": round(dense * 1e3, 1), "TFLOP_s": round(flops_up / dense / 1e9, 1)}
    print(json.dumps(out["dense_bf16_up_shape"]), flush=True)
    del A, B
    ship = G.GroupedTiles(64, 128) if idx.numel() >= 4096 else G.GroupedTiles(16, 64)   # the tiles before this sweep
    up, down, h0, y0 = launches(x, w, idx, st, ship)
    up(); down(); torch.cuda.synchronize()
    h0, y0 = h0.clone(), y0.clone()
    seen_up, seen_down, t0 = {}, {}, time.time()

    def run(c: G.GroupedTiles) -> None:
        ku = (c.bm, c.warps_up, c.stages_up, c.join, c.tile_first)
        kd = (c.bm, c.bn_down, c.warps_down, c.stages_down, c.join, c.tile_first)
        if (ku in seen_up and kd in seen_down) or time.time() - t0 > a.budget: return
        r = {"config": list(c)}
        try:
            up, down, h, y = launches(x, w, idx, st, c)
            up(); down(); torch.cuda.synchronize()
            r["rel_err_h"] = ((h.float() - h0.float()).abs().max() / h0.float().abs().max()).item()
            r["rel_err_y"] = ((y - y0).abs().max() / y0.abs().max()).item()
            if ku not in seen_up:
                t = triton.testing.do_bench(up, rep=60); seen_up[ku] = t
                r["up_us"], r["up_TFLOP_s"] = round(t * 1e3, 1), round(flops_up / t / 1e9, 1)
            if kd not in seen_down:
                t = triton.testing.do_bench(down, rep=60); seen_down[kd] = t
                r["down_us"], r["down_TFLOP_s"] = round(t * 1e3, 1), round(flops_down / t / 1e9, 1)
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["rows"].append(r); print(json.dumps(r), flush=True); save()

    run(ship)
    for join, tf, bm in itertools.product((True, False), (True, False), a.bms[:2]):   # the loop's form first
        run(G.GroupedTiles(bm, 128, 8, 3, 8, 3, join, tf))
    forms = {}
    for (bm, wu, su, join, tf), t in seen_up.items():
        forms[(join, tf, bm)] = t + min(v for k, v in seen_down.items() if k[0] == bm and k[4:] == (join, tf))
    join, tf, bm = min(forms, key=forms.get)
    for bm2 in a.bms:                                                                # then the launch settings
        for wu, su in ((8, 3), (16, 3), (8, 4), (4, 3), (16, 2)):
            for bn, wd, sd in ((256, 8, 3), (256, 16, 3), (128, 8, 3), (128, 4, 3), (256, 8, 4), (64, 4, 3)):
                run(G.GroupedTiles(bm2, bn, wu, su, wd, sd, join, tf))
    if time.time() - t0 > a.budget: out["cut"] = "time budget"
    best_up = min(seen_up.items(), key=lambda kv: kv[1])
    best_down = min(seen_down.items(), key=lambda kv: kv[1])
    out["best_up"] = {"key": list(best_up[0]), "us": round(best_up[1] * 1e3, 1), "TFLOP_s": round(flops_up / best_up[1] / 1e9, 1)}
    out["best_down"] = {"key": list(best_down[0]), "us": round(best_down[1] * 1e3, 1), "TFLOP_s": round(flops_down / best_down[1] / 1e9, 1)}
    print(json.dumps({k: out[k] for k in ("best_up", "best_down")}), flush=True)
    save()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds of sweeping")
    ap.add_argument("--bms", type=int, nargs="+", default=[128, 64, 256], help="pair blocks; the first two in the form sweep")
    main(ap.parse_args())
