"""The FP4 up launch (chapter 18b) on the tensor cores instead of the CUDA cores, beside the production GEMV, at
V4-Flash's expert shapes and 1 token (6 experts), L2 cold.

`fp4_bound_gpu.py` found the production launch bound by its arithmetic, not its loads: every weight is decoded,
converted and multiplied on the CUDA cores (loads alone stream at 2.7 TB/s, the whole body at 1.6). Here an E2M1 code
becomes an e4m3 byte with four integer operations (`(code << 2)` with its sign on bit 7 is the code's value times
2^-6, exactly), the bytes of a 32-input group meet the token's e4m3 activations in one fp8 MMA (`tl.dot`,
`[2·BN, 32] x [32, 16]`, the token in column 0 of 16), and the group's scale (times 2^6) and the activation's
per-128 scale multiply the product. The activations are quantised in the kernel exactly as `act_quant` does.

Prints µs per call and the weight stream in TB/s for the production launch and each tile of the variant, with the
variant's relative error against the production output; writes $OUT/fp4_tc.json.

    OUT=. python benchmarks/scripts/fp4_tc_gpu.py            # H100/H200, about a minute
    python benchmarks/scripts/fp4_tc_gpu.py --cpu-smoke      # small shapes on Triton's interpreter: the values
"""
import argparse, json, os, sys, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from dspark.kernels import fp4_moe as F  # noqa: E402  (switches Triton to its interpreter off CUDA)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _up_tc_kernel(x_ptr, idx_ptr, w13_ptr, s13_ptr, h_ptr, K, D, I, BN: tl.constexpr):
    """Program (pair, block): gate and up rows `block·BN …` of the pair's expert (2·BN interleaved rows of w13), by
    fp8 MMAs over 32-input groups; the SwiGLU of the two into `h` (routing weight 1, no clamp: the comparison's)."""
    p = tl.program_id(0).to(tl.int64)
    n, j = p // K, p % K
    e = tl.load(idx_ptr + n * K + j).to(tl.int64)
    r = tl.arange(0, 2 * BN)
    i = tl.program_id(1) * BN + r // 2
    rows = e * 2 * I + (r % 2) * I + i                        # even r: gate row i; odd r: up row i
    rm = i < I
    w_rows = w13_ptr + rows * (D // 2)
    s_rows = s13_ptr + rows * (D // 32)
    t16, b16, g4 = tl.arange(0, 16), tl.arange(0, 16), tl.arange(0, 4)
    acc = tl.zeros([2 * BN, 16], tl.float32)
    for off in range(0, D, 128):
        xv = tl.load(x_ptr + n * D + off + tl.arange(0, 128)).to(tl.float32)
        ex = F.act_scale_exp(tl.max(tl.abs(xv), 0))
        codes = tl.reshape(F.e4m3(tl.clamp(xv * F.pow2(-ex), -448.0, 448.0)), (4, 32))   # exact e4m3 values
        xs = F.pow2(ex) * 64.0                                # the activation's scale, and 2^6 for the weights' bytes
        for g in tl.static_range(4):
            cg = tl.sum(tl.where(g4[:, None] == g, codes, 0.0), 0)                      # group g's 32 codes
            a = tl.where(t16[None, :] == 0, cg[:, None], 0.0).to(tl.float8e4nv)         # [32, 16]: the token in column 0
            byte = tl.load(w_rows[:, None] + (off + g * 32) // 2 + b16[None, :], mask=rm[:, None], other=0).to(tl.int32)
            lo = (((byte & 7) << 2) | ((byte & 8) << 4)).to(tl.int8)                    # even inputs, e4m3 bits
            hi = (((byte >> 2) & 0x1C) | (byte & 0x80)).to(tl.int8)                     # odd inputs
            wq = tl.reshape(tl.join(lo, hi), (2 * BN, 32)).to(tl.float8e4nv, bitcast=True)
            sc = F.e8m0(s_rows + (off + g * 32) // 32, rm)
            acc += tl.dot(wq, a) * (sc * xs)[:, None]
    v = tl.sum(acc, 1)
    gate, up = tl.split(tl.reshape(v, (BN, 2)))
    io = tl.program_id(1) * BN + tl.arange(0, BN)
    tl.store(h_ptr + p * I + io, gate / (1.0 + tl.exp(-gate)) * up, mask=io < I)


def up_tc(x, idx, st, bn: int, warps: int) -> torch.Tensor:
    N, D = x.shape
    k, I = idx.shape[1], st.w13.shape[1] // 2
    h = torch.empty(N * k, I, dtype=torch.float32, device=x.device)
    _up_tc_kernel[(N * k, triton.cdiv(I, bn))](x, idx, st.w13, st.s13.view(torch.uint8), h, k, D, I, BN=bn, num_warps=warps)
    return h


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    dev = "cpu" if smoke else "cuda"
    D, I, E, K, R = (256, 64, 8, 2, 1) if smoke else (4096, 2048, 256, 6, 8)
    g = torch.Generator(device=dev).manual_seed(0)
    code = lambda *s: torch.randint(-128, 128, s, device=dev, generator=g, dtype=torch.int8)
    scale = lambda *s: torch.randint(118, 122, s, device=dev, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    st = F.FP4Stack(code(E, 2 * I, D // 2), scale(E, 2 * I, D // 32), code(E, D, I // 2), scale(E, D, I // 32), ())
    up_bytes = 2 * I * D // 2 + 2 * I * D // 32
    rs = []
    for _ in range(R):                                        # R routings a timed graph: L2 holds none of them twice
        idx = torch.rand(1, E, device=dev, generator=g).argsort(-1)[:, :K].contiguous()
        rs.append((torch.randn(1, D, device=dev, generator=g).bfloat16(), torch.ones(1, K, device=dev), idx))
    hit = sum(r[2].unique().numel() for r in rs) / R
    us = (lambda fn: 1000 * triton.testing.do_bench_cudagraph(lambda: [fn(*r) for r in rs], rep=30) / R) if not smoke \
        else (lambda fn: [fn(*r) for r in rs] and float("nan"))
    res = {"command": " ".join(sys.argv), "machine": "cpu" if smoke else torch.cuda.get_device_name(),
           "triton": triton.__version__, "rows": []}
    ref = F.fp4_up(*rs[0], st, 0, 1e30)
    cases = [("production", None, None)] + [("tensor cores", bn, wp) for bn, wp in ((32, 4), (64, 4), (64, 8))][:1 if smoke else 3]
    for name, bn, wp in cases:
        row = {"case": name, "bn": bn, "warps": wp}
        try:
            fn = (lambda x, w, i: F.fp4_up(x, w, i, st, 0, 1e30)) if bn is None else (lambda x, w, i, bn=bn, wp=wp: up_tc(x, i, st, bn, wp))
            if bn is not None: row["rel_err"] = ((fn(*rs[0]) - ref).abs().max() / ref.abs().max()).item()
            t = us(fn)
            row.update(us=round(t, 2), tb_s=round(hit * up_bytes / t / 1e6, 3))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            traceback.print_exc(limit=2)
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp4_tc.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
