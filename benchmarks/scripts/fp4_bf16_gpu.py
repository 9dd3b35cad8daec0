"""Chapter 18c's grouped FP4 launches with the weight tile decoded in bf16 pairs (`GroupedTiles.bf16`) against the
same launches decoding through fp32, and against the GEMV launches of chapter 18b, at V4-Flash's experts (D 4096,
I 2048, 256 experts, top-6, random routing) from 16 to 4,096 tokens: each path's µs inside a CUDA graph, the bytes of
the experts it touches over that time, and whether the bf16 decode gives the same bits (it must: both make each
weight value times its power-of-two scale exactly). A second case draws scale bytes over the whole E8M0 range.

    OUT=. python benchmarks/scripts/fp4_bf16_gpu.py [--tokens 16 64 256 384 1024 4096] [--quick]   # $OUT/fp4_bf16.json
"""
import argparse, json, os, sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from dspark.kernels import fp4_grouped as G
from dspark.kernels.fp4_moe import FP4Stack, fp4_moe_small
from fp8_kernels_gpu import graph_us  # one CUDA graph of the calls, replayed between two events

D, I, E, K, LIMIT = 4096, 2048, 256, 6, 10.0


def setup(N: int, g: torch.Generator, lo: int = 118, hi: int = 122):
    code = lambda *s: torch.randint(-128, 128, s, device="cuda", generator=g, dtype=torch.int8)
    scale = lambda *s: torch.randint(lo, hi, s, device="cuda", generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    st = FP4Stack(code(E, 2 * I, D // 2), scale(E, 2 * I, D // 32), code(E, D, I // 2), scale(E, D, I // 32), ())
    x = torch.randn(N, D, device="cuda", generator=g).bfloat16()
    idx = torch.rand(N, E, device="cuda", generator=g).argsort(-1)[:, :K]
    return x, torch.rand(N, K, device="cuda", generator=g), idx, st


def touched_bytes(idx: torch.Tensor, st: FP4Stack) -> int:
    "Bytes of the experts the routing touches (codes and scales of w1, w3 and w2)."
    per = sum(t[0].numel() * t.element_size() for t in (st.w13, st.s13, st.w2, st.s2))
    return int(idx.unique().numel()) * per


def main(a):
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    path = Path(os.environ.get("OUT", "/tmp"), "fp4_bf16.json")
    save = lambda: path.write_text(json.dumps(out, indent=1) + "\n")
    g = torch.Generator(device="cuda").manual_seed(0)
    x, w, idx, st = setup(64, g, 0, 255)                              # every scale byte but NaN's
    ys = [G.fp4_moe_grouped(x, w, idx, st, 0, LIMIT, tiles=G.FP4_TILES_MID._replace(bf16=b)) for b in (False, True)]
    out["whole_scale_range_equal"] = bool(torch.allclose(ys[0], ys[1], rtol=0, atol=0, equal_nan=True))
    print(json.dumps(out), flush=True)
    for N in a.tokens:
        x, w, idx, st = setup(N, g)
        P = idx.numel()
        base = G.FP4_TILES_DENSE if P >= G.FP4_DENSE_PAIRS * E else G.FP4_TILES_MID
        fp32 = base._replace(bf16=False)                              # the shipped tiles decode in bf16 pairs
        row = {"tokens": N, "pairs": P, "touched_GB": round(touched_bytes(idx, st) / 1e9, 3)}
        ref = G.fp4_moe_grouped(x, w, idx, st, 0, LIMIT, tiles=fp32)
        cases = {"shipped": lambda: G.fp4_moe(x, w, idx, st, 0, LIMIT),
                 "grouped_fp32": lambda: G.fp4_moe_grouped(x, w, idx, st, 0, LIMIT, tiles=fp32)}
        variants = ((base.bm, base.warps_up, base.warps_down),) + (() if a.quick else ((16, 4, 4), (32, 4, 4), (64, 8, 8)))
        for bm, wu, wd in variants:
            t = base._replace(bm=bm, warps_up=wu, warps_down=wd, bf16=True)
            if bm > base.bm and base is G.FP4_TILES_MID: continue
            key = f"grouped_bf16_bm{bm}_w{wu}"
            y = G.fp4_moe_grouped(x, w, idx, st, 0, LIMIT, tiles=t)
            row[key + "_equal"] = bool(torch.equal(y, ref)) if t.bm == base.bm else \
                round(((y - ref).abs().max() / ref.abs().max()).item(), 9)
            cases[key] = (lambda t=t: G.fp4_moe_grouped(x, w, idx, st, 0, LIMIT, tiles=t))
        if P <= 4 * G.FP4_SMALL_PAIRS: cases["gemv"] = lambda: fp4_moe_small(x, w, idx, st, 0, LIMIT)
        for k, fn in cases.items():
            try:
                us = graph_us([fn], reps=20)
                row[k + "_us"], row[k + "_TB_s"] = round(us, 1), round(touched_bytes(idx, st) / us / 1e6, 3)
            except Exception as e:
                row[k + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        out["rows"].append(row); print(json.dumps(row), flush=True); save()
    save()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256, 384, 1024, 4096])
    ap.add_argument("--quick", action="store_true", help="only the shipped tiles' block of pairs with the bf16 decode")
    main(ap.parse_args())
