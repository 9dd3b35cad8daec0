"""How much of a decode step's launch gaps programmatic dependent launch (PDL) would win back on Hopper, measured on
a chain shaped like one: a one-block elementwise kernel (an RMS norm's size, 4096 values) feeding the one-row FP8 GEMV
of chapter 18a, whose output feeds the next elementwise kernel, twenty links in one CUDA graph.

Variants of the same chain (same results, checked):
- `plain`: launched as today;
- `pdl`: every kernel launched with `launch_pdl=True`, waiting for its predecessor (`gdc_wait`) before its first load
  and letting its successor start (`gdc_launch_dependents`) right after;
- `pdl+prefetch`: the GEMV loads its first weight tile before it waits (the weights never depend on the kernel
  before), so a link's weight stream starts while the previous kernel drains.

Matrices: `4096 x 4096` (16 MB: streaming) and `512 x 4096` (2 MB: launch-bound, `wkv`'s shape). Weights rotate
through copies twice the L2. Prints µs per link and writes $OUT/pdl_probe.json.

    OUT=. python benchmarks/scripts/pdl_probe_gpu.py          # H100/H200, under a minute
    python benchmarks/scripts/pdl_probe_gpu.py --cpu-smoke    # the plain chain on Triton's interpreter
"""
import argparse, json, math, os, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))

import torch  # noqa: E402
from dspark.kernels import fp8 as F8  # noqa: E402  (switches Triton to its interpreter off CUDA)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fp8_kernels_gpu import copies_for, graph_us, random_fp8  # noqa: E402

D = 4096


@triton.jit
def _scale_kernel(y_ptr, NY, h_ptr, GDC: tl.constexpr):
    "h[i] = 0.5 * y[i % NY] for 4096 values: one program, the size of a decode row's norm."
    i = tl.arange(0, 4096)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    v = tl.load(y_ptr + i % NY).to(tl.float32)
    tl.store(h_ptr + i, (0.5 * v).to(h_ptr.dtype.element_ty))


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, BLOCKS_PER_SPLIT, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
                 FMAX: tl.constexpr, GDC: tl.constexpr, PREFETCH: tl.constexpr):
    "Chapter 18a's one-row GEMV (one group), with the PDL hooks; `PREFETCH` loads the first weight tile before waiting."
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok, nb, kk = n < N, K // 128, tl.arange(0, SUB * 128)
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    ws_rows = ws_ptr + (n // 128) * nb
    first = pid_s * BLOCKS_PER_SPLIT
    if PREFETCH:                         # the weights never depend on the kernel before: read them before waiting
        w0 = tl.load(w_rows + first * 128 + kk[None, :], mask=n_ok[:, None], other=0.0)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N], tl.float32)
    for b in range(first, tl.minimum(first + BLOCKS_PER_SPLIT, nb), SUB):
        xq, xs = F8._quant_slab(tl.reshape(tl.load(x_ptr + b * 128 + kk).to(tl.float32), (SUB, 128)), FMAX)
        if PREFETCH and b == first: w = w0.to(tl.float32)
        else: w = tl.load(w_rows + b * 128 + kk[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        part = tl.sum(tl.reshape(w, (BLOCK_N, SUB, 128)) * xq[None, :, :], 2)
        wsc = tl.exp2(tl.load(ws_rows[:, None] + b + tl.arange(0, SUB)[None, :], mask=n_ok[:, None], other=127)
                      .to(tl.float32) - 127.0)
        acc += tl.sum(part * wsc * xs[None, :], 1)
    tl.store(out_ptr + pid_s.to(tl.int64) * N + n, acc, mask=n_ok)


@triton.jit
def _sum_kernel(part_ptr, y_ptr, N, SPLITS: tl.constexpr, GDC: tl.constexpr):
    "y = the split partials' sum, in split order (chapter 18a's `_split_sum_kernel` with the PDL hooks)."
    i = tl.program_id(0) * 1024 + tl.arange(0, 1024)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([1024], tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * N + i, mask=i < N, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=i < N)


def link(h, w, s, part, y, variant: str):
    "One link: h -> GEMV partials -> y (their sum) -> the next h. `variant`: plain, pdl, pdl+prefetch (or prefetch)."
    gdc = variant.startswith("pdl")
    kw = {"launch_pdl": True} if gdc else {}
    N, K = w.shape
    split = part.shape[0]
    _gemv_kernel[(triton.cdiv(N, 32), split)](h, w, s.view(torch.uint8), part, N, K, K // 128 // split, BLOCK_N=32, SUB=4,
                                              FMAX=F8.FP8_MAX, GDC=gdc, PREFETCH=variant.endswith("prefetch"), num_warps=4, **kw)
    _sum_kernel[(triton.cdiv(N, 1024),)](part, y, N, SPLITS=split, GDC=gdc, **kw)
    _scale_kernel[(1,)](y, N, h, GDC=gdc, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    dev = "cpu" if smoke else "cuda"
    torch.set_grad_enabled(False)
    g = torch.Generator(device=dev).manual_seed(0)
    res = {"command": " ".join(sys.argv), "machine": "cpu" if smoke else torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": triton.__version__, "rows": []}
    variants = ("plain", "prefetch") if smoke else ("plain", "pdl", "pdl+prefetch")   # prefetch alone: the interpreter's check
    links = 2 if smoke else 20
    for O, split in ((D, 4), (512, 8)):
        w, s = random_fp8(O, D, dev, g)
        n = copies_for(O * D + s.numel(), smoke)
        ws = [(w.clone(), s.clone()) for _ in range(n)]
        outs, h0 = {}, torch.randn(D, device=dev, generator=g).bfloat16()
        for v in variants:
            h = h0.clone()
            part = torch.empty(split, O, device=dev)
            y = torch.empty(O, device=dev, dtype=torch.bfloat16)
            calls = [(lambda i=i: link(h, *ws[i % n], part, y, v)) for i in range(links)]
            row = {"O": O, "I": D, "split": split, "variant": v, "links": links}
            try:
                h.copy_(h0)
                for c in calls: c()
                outs[v] = h.float().clone()
                us = graph_us(calls)
                row.update(us_per_link=round(us, 2), weight_tb_s=round((O * D + s.numel()) / us / 1e6, 3))
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            if v != "plain" and v in outs and "plain" in outs:
                row["max_diff_vs_plain"] = (outs[v] - outs["plain"]).abs().max().item()
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "pdl_probe.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
