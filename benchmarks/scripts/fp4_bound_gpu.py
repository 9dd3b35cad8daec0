"""What bounds the FP4 GEMV up launch (chapter 18b) at V4-Flash's expert shapes: the production kernel beside
variants that each drop or change one part -- the decode, the conversion, the per-group sums, the tile, the loop's
software pipelining (`tl.range(..., num_stages)`) -- at 1 and 16 tokens, L2 cold (8 routings a timed graph). A variant that is much faster than the kernel names the part that
costs. Variants that compute the same values are checked against the reference.

    OUT=. python benchmarks/scripts/fp4_bound_gpu.py     # H100/H200, about 2 minutes; writes $OUT/fp4_bound.json
"""
import json, os, sys, time, traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dspark.kernels import fp4_moe as F

D, I, E, K, LIMIT, R = 4096, 2048, 256, 6, 10.0, 8
g = torch.Generator(device="cuda").manual_seed(0)
out = {"gpu": torch.cuda.get_device_name(), "rows": []}
path = Path(os.environ.get("OUT", "/tmp"), "fp4_bound.json")

@triton.jit
def _fp32_nibbles(byte):
    "Codes straight to fp32 bits of value * 2^-126 (code 1 an fp32 subnormal): no fp16 and no conversion."
    b = byte.to(tl.int32)
    lo = (((b & 7) << 22) | ((b & 8) << 28)).to(tl.float32, bitcast=True)
    hi = (((b & 0x70) << 18) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return lo, hi

@triton.jit
def _variant_dot(w_ptr, s_ptr, rows, rm, a_ptr, KT, ROWS: tl.constexpr, KC: tl.constexpr, MODE: tl.constexpr,
                 STAGES: tl.constexpr):
    jb = tl.arange(0, KC // 2)
    w_rows = w_ptr + rows * (KT // 2)
    s_rows = s_ptr + rows * (KT // 32)
    acc = tl.zeros([ROWS], tl.float32)
    acc2 = tl.zeros([ROWS, KC // 2], tl.float32)
    for off in tl.range(0, KT, KC, num_stages=STAGES):
        byte = tl.load(w_rows[:, None] + off // 2 + jb[None, :], mask=rm[:, None], other=0)
        if MODE == 0:      # loads only: the bytes summed as integers
            acc += tl.sum(byte.to(tl.int32), 1).to(tl.float32)
        elif MODE == 1:    # loads + activation quantisation + PTX decode + conversion + FMA, no scales, no group sums
            ae, ao = F._act_chunk(a_ptr + off, KC)
            lo, hi = F.nibbles(byte, True)
            acc2 += lo * ae[None, :] + hi * ao[None, :]
        elif MODE == 2:    # the production body with the scales applied to the decoded weights, one sum at the end
            ae, ao = F._act_chunk(a_ptr + off, KC)
            lo, hi = F.nibbles(byte, True)
            sc = _scales(s_rows, off, rm, ROWS, KC)
            acc2 += tl.reshape(tl.reshape(lo * ae[None, :] + hi * ao[None, :], (ROWS, KC // 32, 16)) * sc[:, :, None], (ROWS, KC // 2))
        elif MODE == 3:    # fp32 decode (no conversion), scales times 2^126 applied per group
            ae, ao = F._act_chunk(a_ptr + off, KC)
            lo, hi = _fp32_nibbles(byte)
            part = tl.sum(tl.reshape(lo * ae[None, :] + hi * ao[None, :], (ROWS, KC // 32, 16)), 2)
            sc = _scales(s_rows, off, rm, ROWS, KC) * 8.507059173023462e+37   # 2^126
            acc += tl.sum(part * sc, 1)
        else:              # MODE 4: the production body on raw activations (as with activations quantised first)
            j = tl.arange(0, KC // 2)
            ae = tl.load(a_ptr + off + 2 * j).to(tl.float32)
            ao = tl.load(a_ptr + off + 2 * j + 1).to(tl.float32)
            lo, hi = F.nibbles(byte, True)
            part = tl.sum(tl.reshape(lo * ae[None, :] + hi * ao[None, :], (ROWS, KC // 32, 16)), 2)
            acc += tl.sum(part * _scales(s_rows, off, rm, ROWS, KC), 1)
    return acc + tl.sum(acc2, 1)

@triton.jit
def _scales(s_rows, off, rm, ROWS: tl.constexpr, KC: tl.constexpr):
    return F.e8m0(s_rows[:, None] + off // 32 + tl.arange(0, KC // 32)[None, :], rm[:, None]) * 16384.0

@triton.jit
def _variant_up(x_ptr, idx_ptr, w13_ptr, s13_ptr, h_ptr, K, D, I, BN: tl.constexpr, KC: tl.constexpr, MODE: tl.constexpr,
                STAGES: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    n, j = p // K, p % K
    e = tl.load(idx_ptr + n * K + j).to(tl.int64)
    r = tl.arange(0, 2 * BN)
    i = tl.program_id(1) * BN + r // 2
    rows = e * 2 * I + (r % 2) * I + i
    acc = _variant_dot(w13_ptr, s13_ptr, rows, i < I, x_ptr + n * D, D, 2 * BN, KC, MODE, STAGES)
    gate, up = tl.split(tl.reshape(acc, (BN, 2)))
    io = tl.program_id(1) * BN + tl.arange(0, BN)
    tl.store(h_ptr + p * I + io, gate / (1.0 + tl.exp(-gate)) * up, mask=io < I)

code = lambda *s: torch.randint(-128, 128, s, device="cuda", generator=g, dtype=torch.int8)
scale = lambda *s: torch.randint(118, 122, s, device="cuda", generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
st = F.FP4Stack(code(E, 2 * I, D // 2), scale(E, 2 * I, D // 32), code(E, D, I // 2), scale(E, D, I // 32), ())
UP_BYTES = 2 * I * D // 2 + 2 * I * D // 32

def us_per_call(fn, rs):
    return 1000 * triton.testing.do_bench_cudagraph(lambda: [fn(*r) for r in rs], rep=30) / len(rs)

t0 = time.time()
for N in (1, 16):
    rs = []
    for _ in range(R):
        idx = torch.rand(N, E, device="cuda", generator=g).argsort(-1)[:, :K].contiguous()
        rs.append((torch.randn(N, D, device="cuda", generator=g).bfloat16(), torch.ones(N, K, device="cuda"), idx))
    hit = sum(r[2].unique().numel() for r in rs) / R
    ref_h = F.fp4_up(*rs[0], st, 0, 1e30)
    prod = lambda x, w, i: F.fp4_up(x, w, i, st, 0, LIMIT)
    cases = [("production", None, 16, 256, 4, None)]
    for mode in range(5):
        for bn, kc, wp in ((16, 256, 4), (32, 512, 8)):
            cases.append((f"mode{mode}", mode, bn, kc, wp, None))
    for stages in (2, 3, 4):                 # the loop software-pipelined: more weight bytes in flight a program
        for mode in (0, 4):
            cases.append((f"mode{mode}_stages{stages}", mode, 16, 256, 4, stages))
    cases += [("production", None, 32, 512, 8, None), ("production", None, 8, 512, 4, None), ("production", None, 16, 512, 8, None)]
    for name, mode, bn, kc, wp, stages in cases:
        try:
            if mode is None:
                t = F.GemvTiles(up_bn=bn, up_kc=kc, up_warps=wp)
                fn = lambda x, w, i, t=t: F.fp4_up(x, w, i, st, 0, LIMIT, t)
            else:
                def fn(x, w, i, mode=mode, bn=bn, kc=kc, wp=wp, stages=stages):
                    h = torch.empty(N * K, I, device="cuda")
                    _variant_up[(N * K, I // bn)](x, i, st.w13, st.s13.view(torch.uint8), h, K, D, I, BN=bn, KC=kc, MODE=mode,
                                                  STAGES=stages, num_warps=wp)
                    return h
            us = us_per_call(fn, rs)
            row = {"N": N, "case": name, "bn": bn, "kc": kc, "warps": wp, "us": round(us, 2), "TB_s": round(hit * UP_BYTES / us / 1e6, 3)}
            if mode in (2, 3):     # same values as the kernel before its clamp (limit huge, weights 1)
                got = fn(*rs[0])
                row["rel_err_vs_kernel"] = ((got - ref_h).abs().max() / ref_h.abs().max()).item()
        except Exception as e:
            row = {"N": N, "case": name, "bn": bn, "kc": kc, "error": f"{type(e).__name__}: {str(e)[:300]}"}
            traceback.print_exc(limit=2)
        out["rows"].append(row); print(json.dumps(row), flush=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
print(f"done in {time.time() - t0:.0f} s")
