"""Chapter 18b's FP4 GEMV launches against the grouped tensor-core launches of chapter 18c (each with the Triton and the PTX decode: grouped_dec1, grouped_dec2), at V4-Flash's expert shapes (D 4096, I 2048, 256 experts, top-6) on the GPU: the PTX decode against the
arithmetic one for all 256 bytes, parity of every configuration with the reference, and µs a call with the L2 cold
(each timed graph replays the call over 8 routings of distinct experts). TB/s counts the selected experts' codes and
scales read (distinct experts hit). The `gemv` rows are the launches as shipped (activations quantised first); the
record of commit cc0f89c calls those `gemv_prequant` and its `gemv` rows quantise in every program.

    OUT=. python benchmarks/scripts/fp4_gemv_gpu.py      # H100/H200, about 4 minutes; writes $OUT/fp4_gemv.json
"""
import itertools, json, os, sys, time, traceback
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dspark.kernels import fp4_moe as F
from dspark.kernels.fp4_grouped import fp4_moe_grouped

D, I, E, K, LIMIT, R = 4096, 2048, 256, 6, 10.0, 8
g = torch.Generator(device="cuda").manual_seed(0)
out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": []}
path = Path(os.environ.get("OUT", "/tmp"), "fp4_gemv.json")
def save(): path.write_text(json.dumps(out, indent=1) + "\n")
def row(r): out["rows"].append(r); print(json.dumps(r), flush=True); save()

@triton.jit
def _decode_kernel(b_ptr, lo_ptr, hi_ptr, ASM: tl.constexpr):
    j = tl.arange(0, 256)
    lo, hi = F.nibbles(tl.load(b_ptr + j), ASM)
    tl.store(lo_ptr + j, lo); tl.store(hi_ptr + j, hi)

def decode_check():
    b = torch.arange(-128, 128, dtype=torch.int8, device="cuda")
    res = []
    for asm in (False, True):
        lo, hi = torch.empty(256, device="cuda"), torch.empty(256, device="cuda")
        _decode_kernel[(1,)](b, lo, hi, ASM=asm); res.append((lo, hi))
    u = b.view(torch.uint8).int()
    vals = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6], device="cuda")
    val = lambda c: torch.where(c >= 8, -vals[c & 7], vals[c & 7]) * 2.0 ** -14
    want = (val(u & 15), val(u >> 4))
    return {"case": "decode", "arith_ok": all(torch.equal(a, w) for a, w in zip(res[0], want)),
            "asm_ok": all(torch.equal(a, w) for a, w in zip(res[1], want))}

code = lambda *s: torch.randint(-128, 128, s, device="cuda", generator=g, dtype=torch.int8)
scale = lambda *s: torch.randint(118, 122, s, device="cuda", generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
st = F.FP4Stack(code(E, 2 * I, D // 2), scale(E, 2 * I, D // 32), code(E, D, I // 2), scale(E, D, I // 32), ())
EXPERT_BYTES = 3 * I * D // 2 + 3 * I * D // 32

def routings(N):
    "R routings of N tokens; each routing's experts distinct from the previous one's where 256 allow it."
    outs = []
    for r in range(R):
        perm = torch.randperm(E, device="cuda", generator=g)
        idx = torch.stack([perm[(t * K + torch.arange(K, device="cuda")) % E] for t in range(N)]) if N * K <= E else \
            torch.rand(N, E, device="cuda", generator=g).argsort(-1)[:, :K]
        outs.append((torch.randn(N, D, device="cuda", generator=g).bfloat16(), torch.rand(N, K, device="cuda", generator=g), idx))
    return outs

def us_per_call(fn, rs) -> float:
    return 1000 * triton.testing.do_bench_cudagraph(lambda: [fn(*r) for r in rs], rep=30) / len(rs)

def tb(us, rs, part=1.0):
    hit = sum(r[2].unique().numel() for r in rs) / len(rs)
    return round(hit * EXPERT_BYTES * part / us / 1e6, 3)

def rel(a, b): return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

def guarded(name, fn):
    try: return fn()
    except Exception as e:
        r = {"case": name, "error": f"{type(e).__name__}: {str(e)[:300]}"}; traceback.print_exc(limit=2); row(r); return None

t0 = time.time()
dc = guarded("decode", decode_check)
if dc: row(dc)
ASM = bool(dc and dc["asm_ok"])          # a PTX decode that fails to build or disagrees is left out
UP_PART, DOWN_PART = 2 / 3, 1 / 3
best = {}
for N in (1, 16):
    rs = routings(N)
    x, w, idx = rs[0]
    h_ref = F.fp4_up_ref(x[:4], w[:4], idx[:4], st, 0, LIMIT)
    y_ref = F.fp4_down_ref(h_ref, idx[:4], st, 0)
    hs = [(F.fp4_up(x, w, i, st, 0, LIMIT), i) for x, w, i in rs]
    ups, downs = [], []
    for asm, bn, kc, wp in itertools.product((ASM,), (8, 16, 32), (128, 256, 512), (4, 8)):
        t = F.GemvTiles(up_bn=bn, up_kc=kc, up_warps=wp, asm=asm)
        def up_case():
            err = rel(F.fp4_up(x[:4], w[:4], idx[:4], st, 0, LIMIT, t), h_ref)
            us = us_per_call(lambda x, w, i: F.fp4_up(x, w, i, st, 0, LIMIT, t), rs)
            return {"case": "gemv_up", "N": N, "asm": asm, "bn": bn, "kc": kc, "warps": wp, "us": round(us, 2), "TB_s": tb(us, rs, UP_PART), "rel_err": err}
        r = guarded("gemv_up", up_case)
        if r: row(r); ups.append(r)
    for asm, bn, kc, wp in itertools.product((ASM,), (16, 32, 64), (128, 256, 512), (4, 8)):
        t = F.GemvTiles(down_bn=bn, down_kc=kc, down_warps=wp, asm=asm)
        def down_case():
            err = rel(F.fp4_down(h_ref, idx[:4], st, 0, t), y_ref)
            us = us_per_call(lambda h, i: F.fp4_down(h, i, st, 0, t), hs)
            return {"case": "gemv_down", "N": N, "asm": asm, "bn": bn, "kc": kc, "warps": wp, "us": round(us, 2), "TB_s": tb(us, rs, DOWN_PART), "rel_err": err}
        r = guarded("gemv_down", down_case)
        if r: row(r); downs.append(r)
    ok = lambda rr: [r for r in rr if r["rel_err"] < 1e-5]
    if ok(ups) and ok(downs):
        bu, bd = min(ok(ups), key=lambda r: r["us"]), min(ok(downs), key=lambda r: r["us"])
        best[N] = F.GemvTiles(bu["bn"], bu["kc"], bu["warps"], bd["bn"], bd["kc"], bd["warps"], ASM)
        # the same tiles with the other decode
        ta = F.GemvTiles(bu["bn"], bu["kc"], bu["warps"], bd["bn"], bd["kc"], bd["warps"], not ASM)
        r = guarded("arith", lambda: {"case": "gemv_other_decode", "N": N, "asm": not ASM, "up_us": round(us_per_call(lambda x, w, i: F.fp4_up(x, w, i, st, 0, LIMIT, ta), rs), 2),
                                      "down_us": round(us_per_call(lambda h, i: F.fp4_down(h, i, st, 0, ta), hs), 2)})
        if r: row(r)
        row({"case": "best_tiles", "N": N, "tiles": best[N].__dict__, "up_us": bu["us"], "down_us": bd["us"]})
    del hs, rs
print(f"sweep done in {time.time() - t0:.0f} s", flush=True)

# whole MoE: old small, gemv (best tiles of N=16, and of N=1), grouped with each decode
tiles = best.get(16) or best.get(1) or F.GemvTiles()
for N in (1, 4, 16, 32, 64, 256):
    rs = routings(N)
    x, w, idx = rs[0]
    ref = F.fp4_moe_ref(x[:4], w[:4], idx[:4], st, 0, LIMIT)
    paths = {"gemv": lambda x, w, i: F.fp4_moe_small(x, w, i, st, 0, LIMIT, tiles)}
    if 1 in best: paths["gemv_n1tiles"] = lambda x, w, i: F.fp4_moe_small(x, w, i, st, 0, LIMIT, best[1])
    for asm in (False, True):
        paths[f"grouped_dec{1 + asm}"] = lambda x, w, i, asm=asm: fp4_moe_grouped(x, w, i, st, 0, LIMIT, 16 if N < 512 else 64, 64 if N < 512 else 128, asm=asm)
    for name, fn in paths.items():
        def moe_case():
            err = rel(fn(x[:4], w[:4], idx[:4]), ref)
            us = us_per_call(fn, rs)
            return {"case": "moe", "path": name, "N": N, "us": round(us, 2), "TB_s": tb(us, rs), "rel_err": err}
        r = guarded(name, moe_case)
        if r: row(r)
    del rs
out["seconds"] = round(time.time() - t0, 1); save()
print(f"wrote {path} in {time.time() - t0:.0f} s")
