"""Candidate FP8 kernels for the decode step's few rows, beside chapter 18a's split-K `tl.dot` kernel, at V4-Flash's
FP8 matrices and at the two stacks a layer could make of them (`w1|w3` of the shared expert, `wq_a|wkv`):

- `gemv`: one row, no tensor cores: each program streams `[BLOCK_N, 128·SUB]` e4m3 tiles, converts them in registers
  and multiplies by the row quantised as `act_quant` (`SUB` scale blocks per loop trip, `tl.range(num_stages)`);
- `preq`: the `tl.dot` kernel fed by activations quantised once (`act_quant_triton`), not in every program;
- `gemv_rows` (`--rows`, alone): the GEMV for a verify or draft step's 2-16 rows, each tile widened once for all
  of them (config = ROWS, BLOCK_N, SUB, split, warps). Not yet run on a GPU.

Each config is checked against `fp8_linear_ref` on the first copy and timed as in `fp8_kernels_gpu.py` (a CUDA graph
over a rotation of weight copies twice the L2). Then one layer's FP8 weights at one row in one graph: the kernel as
shipped, the best gemv config of each matrix, and the same with the two stacks.

    OUT=. python benchmarks/scripts/fp8_gemv_gpu.py              # H100/H200, about 3 minutes; $OUT/fp8_gemv.json
    OUT=. python benchmarks/scripts/fp8_gemv_gpu.py --rows       # the few-row GEMV only
    python benchmarks/scripts/fp8_gemv_gpu.py --cpu-smoke        # tiny shapes on Triton's interpreter
"""
import argparse, itertools, json, os, sys, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "scripts"))

import torch  # noqa: E402
from dspark.kernels import fp8 as F8  # noqa: E402  (switches Triton to its interpreter off CUDA)
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from fp8_kernels_gpu import copies_for, graph_us, random_fp8, rel_err  # noqa: E402

SHAPES = {"wq_a": (1024, 4096), "wkv": (512, 4096), "wq_a|wkv": (1536, 4096), "wq_b": (32768, 1024),
          "wo_a": (8192, 4096), "wo_b": (4096, 8192), "shared.w1": (2048, 4096), "shared.w1|w3": (4096, 4096),
          "shared.w2": (4096, 2048), "indexer.wq_b": (8192, 1024)}
LAYER = ("wq_a", "wkv", "wq_b", "wo_a", "wo_b", "shared.w1", "shared.w1", "shared.w2", "indexer.wq_b")
STACKED = ("wq_a|wkv", "wq_b", "wo_a", "wo_b", "shared.w1|w3", "shared.w2", "indexer.wq_b")


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, N, K, BLOCKS_PER_SPLIT, BLOCK_N: tl.constexpr, SUB: tl.constexpr,
                 STAGES: tl.constexpr, FMAX: tl.constexpr):
    "Program (n, s): columns n·BLOCK_N… of one row's product over split s (BLOCKS_PER_SPLIT 128-blocks, SUB a trip)."
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    nb = K // 128
    kk = tl.arange(0, SUB * 128)
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    ws_rows = ws_ptr + (n // 128) * nb
    acc = tl.zeros([BLOCK_N], tl.float32)
    first = pid_s * BLOCKS_PER_SPLIT
    for b in tl.range(first, tl.minimum(first + BLOCKS_PER_SPLIT, nb), SUB, num_stages=STAGES):
        xv = tl.reshape(tl.load(x_ptr + b * 128 + kk).to(tl.float32), (SUB, 128))
        xq, xs = F8._quant_slab(xv, FMAX)                                        # [SUB, 128], [SUB]
        w = tl.load(w_rows + b * 128 + kk[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32)
        part = tl.sum(tl.reshape(w, (BLOCK_N, SUB, 128)) * xq[None, :, :], 2)   # [BLOCK_N, SUB]
        wsc = tl.exp2(tl.load(ws_rows[:, None] + b + tl.arange(0, SUB)[None, :], mask=n_ok[:, None], other=127)
                      .to(tl.float32) - 127.0)
        acc += tl.sum(part * wsc * xs[None, :], 1)
    tl.store(out_ptr + pid_s.to(tl.int64) * N + n, acc, mask=n_ok)


@triton.jit
def _gemv_rows_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, BLOCKS_PER_SPLIT, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                      SUB: tl.constexpr, FMAX: tl.constexpr):
    """`_gemv_kernel` for up to ROWS rows: each e4m3 tile is widened once and met by every row in turn (no tensor
    cores: a verify or draft step's few rows would fill a few of the MMA's 16)."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok, nb, kk, rr = n < N, K // 128, tl.arange(0, SUB * 128), tl.arange(0, ROWS)
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    ws_rows = ws_ptr + (n // 128) * nb
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    first = pid_s * BLOCKS_PER_SPLIT
    for b in range(first, tl.minimum(first + BLOCKS_PER_SPLIT, nb), SUB):
        w = tl.reshape(tl.load(w_rows + b * 128 + kk[None, :], mask=n_ok[:, None], other=0.0).to(tl.float32),
                       (BLOCK_N, SUB, 128))
        wsc = tl.exp2(tl.load(ws_rows[:, None] + b + tl.arange(0, SUB)[None, :], mask=n_ok[:, None], other=127)
                      .to(tl.float32) - 127.0)
        for r in tl.static_range(ROWS):
            xv = tl.load(x_ptr + r * K + b * 128 + kk, mask=(kk * 0 + r) < M, other=0.0).to(tl.float32)
            xq, xs = F8._quant_slab(tl.reshape(xv, (SUB, 128)), FMAX)
            part = tl.sum(tl.sum(w * xq[None, :, :], 2) * wsc * xs[None, :], 1)              # [BLOCK_N]
            acc += tl.where(rr[:, None] == r, part[None, :], 0.0)
    out = out_ptr + pid_s.to(tl.int64) * M * N + rr[:, None].to(tl.int64) * N + n[None, :]
    tl.store(out, acc, mask=(rr[:, None] < M) & n_ok[None, :])


@triton.jit
def _preq_kernel(xq_ptr, xs_ptr, Mp, w_ptr, ws_ptr, out_ptr, M, N, K, BLOCKS_PER_SPLIT,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr):
    "The split-K `tl.dot` kernel reading e4m3 activations and their block scales `[K/128, Mp]` made once."
    pid_n, pid_s, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, 128)
    m_ok, n_ok = m < M, n < N
    nb = K // 128
    x_rows = xq_ptr + m[:, None].to(tl.int64) * K
    w_rows = w_ptr + n[:, None].to(tl.int64) * K
    ws_rows = ws_ptr + (n // 128) * nb
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = pid_s * BLOCKS_PER_SPLIT
    for b in tl.range(first, tl.minimum(first + BLOCKS_PER_SPLIT, nb), num_stages=STAGES):
        xq = tl.load(x_rows + b * 128 + kk[None, :], mask=m_ok[:, None], other=0.0)
        xs = tl.load(xs_ptr + b * Mp + m, mask=m_ok, other=0.0)
        wq = tl.load(w_rows + b * 128 + kk[None, :], mask=n_ok[:, None], other=0.0)
        wsc = tl.exp2(tl.load(ws_rows + b, mask=n_ok, other=127).to(tl.float32) - 127.0)
        acc += tl.dot(xq, tl.trans(wq)) * xs[:, None] * wsc[None, :]
    tl.store(out_ptr + pid_s.to(tl.int64) * M * N + m[:, None].to(tl.int64) * N + n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


def splits_sum(out: torch.Tensor, y: torch.Tensor) -> None:
    S = out.shape[0]
    if S == 1: y.copy_(out[0])
    else: F8.launch(F8._split_sum_kernel, (triton.cdiv(y.numel(), 1024),), out, y, y.numel(), SPLITS=S, BLOCK=1024)


def gemv(x, w, s, c):
    "One row through `_gemv_kernel` with c = (BLOCK_N, SUB, split, warps, stages)."
    bn, sub, split, warps, stages = c
    N, Kd = w.shape
    per = triton.cdiv(Kd // 128, split)
    per = triton.cdiv(per, sub) * sub
    S = triton.cdiv(Kd // 128, per)
    out = torch.empty(S, N, dtype=torch.float32, device=x.device)
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn), S)](x, w, s.view(torch.uint8), out, N, Kd, per, BLOCK_N=bn, SUB=sub,
                                          STAGES=stages, FMAX=F8.FP8_MAX, num_warps=warps)
    splits_sum(out, y)
    return y


def gemv_rows(x, w, s, c):
    "M <= ROWS rows through `_gemv_rows_kernel` with c = (ROWS, BLOCK_N, SUB, split, warps)."
    rows, bn, sub, split, warps = c
    M, Kd = x.shape
    N = w.shape[0]
    per = triton.cdiv(triton.cdiv(Kd // 128, split), sub) * sub
    S = triton.cdiv(Kd // 128, per)
    out = torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv_rows_kernel[(triton.cdiv(N, bn), S)](x, w, s.view(torch.uint8), out, M, N, Kd, per, ROWS=rows, BLOCK_N=bn,
                                               SUB=sub, FMAX=F8.FP8_MAX, num_warps=warps)
    splits_sum(out.view(S, M * N), y.view(M * N))
    return y


def preq(x, w, s, c):
    "`act_quant_triton` once, then `_preq_kernel` with c = (BLOCK_M, BLOCK_N, split, warps, stages)."
    bm, bn, split, warps, stages = c
    M, Kd = x.shape
    N = w.shape[0]
    xq, xs = F8.act_quant_triton(x)
    Mp = xq.shape[0]
    per = triton.cdiv(Kd // 128, split)
    S = triton.cdiv(Kd // 128, per)
    out = torch.empty(S, M, N, dtype=torch.float32, device=x.device)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _preq_kernel[(triton.cdiv(N, bn), S, triton.cdiv(M, bm))](xq, xs.t(), Mp, w, s.view(torch.uint8), out, M, N, Kd, per,
                                                            BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, num_warps=warps)
    splits_sum(out.view(S, M * N), y.view(M * N))
    return y


def sweep(res, name, kind, M, fn, configs, x, wc, sc, ref, nbytes, budget):
    "Time every config of `fn` on one matrix; the parity of each on copy 0; the best into the row."
    row = {"matrix": name, "kind": kind, "M": M, "O": wc[0].shape[0], "I": wc[0].shape[1], "configs": []}
    n, t0 = len(wc), time.perf_counter()
    for c in configs:
        if time.perf_counter() - t0 > budget: row["skipped"] = "time budget"; break
        r = {"config": list(c) if c else None}
        try:
            r["rel_err"] = round(rel_err(fn(x, wc[0], sc[0], c), ref), 6)
            us = graph_us([(lambda i=i: fn(x, wc[i % n], sc[i % n], c)) for i in range(max(20, n))])
            r.update(us=round(us, 2), tb_s=round(nbytes / us / 1e6, 3))
        except Exception as e: r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["configs"].append(r)
    ok = [r for r in row["configs"] if "us" in r and r["rel_err"] < 2 ** -7 + 1e-3]
    row["best"] = min(ok, key=lambda r: r["us"]) if ok else None
    row["errors"] = [r for r in row["configs"] if "error" in r][:2]
    res["rows"].append(row)
    b = row["best"]
    print(f"{name:14s} {kind:6s} M={M:<3d} best {b and b['us']} us {b and b['tb_s']} TB/s {b and b['config']}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=30.0, help="seconds for one matrix's sweep at one M")
    ap.add_argument("--rows", action="store_true", help="only the few-row GEMV against the shipped kernel, at 2, 4, 8, 16 rows")
    args = ap.parse_args()
    smoke = args.cpu_smoke
    dev = "cpu" if smoke else "cuda"
    t0 = time.perf_counter()
    torch.set_grad_enabled(False)
    g = torch.Generator(device=dev).manual_seed(0)
    shapes = {"wq_a": (256, 512), "wkv": (128, 512)} if smoke else SHAPES
    if smoke:
        gemv_cfgs = [(64, 2, 2, 4, 2)]
        preq_cfgs = [(16, 64, 1, 4, 2)]
    else:
        gemv_cfgs = [(bn, sub, sp, wp, st) for bn, sub, wp, st in itertools.product((32, 64, 128), (1, 2, 4), (4, 8), (1, 3))
                     if bn * sub * 128 <= 32768 for sp in (1, 2, 4, 8, 16)]
        preq_cfgs = [(bm, bn, sp, wp, st) for bm in (16, 64) for bn, wp, st in ((64, 4, 3), (128, 4, 3), (128, 8, 3), (128, 4, 4))
                     for sp in (1, 2, 4, 8)]
    res = {"command": " ".join(sys.argv), "machine": torch.cuda.get_device_name() if not smoke else "cpu",
           "torch": torch.__version__, "triton": triton.__version__, "rows": [], "layer": []}
    weights, best_gemv = {}, {}
    if args.rows:
        rows_sweep(res, shapes, smoke, dev, g, args.budget_s)
        print(f"wrote {save(res)}")
        return
    for name, (O, I) in shapes.items():
        w, s = random_fp8(O, I, dev, g)
        nbytes = O * I + s.numel()
        n = copies_for(nbytes, smoke)
        wc, sc = [w] + [w.clone() for _ in range(n - 1)], [s] + [s.clone() for _ in range(n - 1)]
        weights[name] = (wc, sc, nbytes)
        for M in (1, 16, 64):
            x = torch.randn(M, I, device=dev, generator=g).bfloat16()
            ref = F8.fp8_linear_ref(x, w, s)
            n_blocks = I // 128
            ship = lambda x, w, s, c: F8.fp8_linear_triton(x, w, s)
            sweep(res, name, "ship", M, ship, [None], x, wc, sc, ref, nbytes, 1e9)
            if M == 1:
                sms = 132 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
                cf = [c for c in gemv_cfgs if n_blocks // c[2] >= c[1] and (n_blocks // c[2]) % c[1] == 0
                      and (smoke or sms // 2 <= -(-O // c[0]) * c[2] <= 6 * sms)]     # half a wave to six waves
                row = sweep(res, name, "gemv", M, gemv, cf, x, wc, sc, ref, nbytes, args.budget_s)
                if row["best"]: best_gemv[name] = tuple(row["best"]["config"])
            cf = [c for c in preq_cfgs if (c[0] == 16) == (M <= 16) and c[2] <= n_blocks]
            sweep(res, name, "preq", M, preq, cf, x, wc, sc, ref, nbytes, args.budget_s)
        if not smoke: torch.cuda.empty_cache()
        save(res)
    # one layer's FP8 weights at one row, one graph
    x1 = {I: torch.randn(1, I, device=dev, generator=g).bfloat16() for I in {i for _, i in shapes.values()}}
    def layer(names, fn_of):
        names = [k for k in names if k in weights]
        if not names: return {"skipped": "no such matrices here"}
        calls = [(lambda k=k: fn_of(k)(x1[shapes[k][1]], weights[k][0][0], weights[k][1][0])) for k in names]
        nbytes = sum(weights[k][2] for k in names)
        us = graph_us(calls) * len(calls)
        return {"matrices": names, "bytes": nbytes, "us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3)}
    for label, names, fn_of in (
            ("shipped kernel", LAYER, lambda k: F8.fp8_linear_triton),
            ("best gemv", LAYER, lambda k: (lambda x, w, s, c=best_gemv.get(k): gemv(x, w, s, c) if c else F8.fp8_linear_triton(x, w, s))),
            ("best gemv, stacked", STACKED, lambda k: (lambda x, w, s, c=best_gemv.get(k): gemv(x, w, s, c) if c else F8.fp8_linear_triton(x, w, s))),
            ("shipped kernel, stacked", STACKED, lambda k: F8.fp8_linear_triton)):
        try: r = layer(names, fn_of)
        except Exception as e: r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        r["label"] = label
        res["layer"].append(r)
        print(json.dumps(r), flush=True)
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"wrote {save(res)} in {res['wall_s']} s")


def rows_sweep(res, shapes, smoke, dev, g, budget) -> None:
    "`--rows`: the shipped kernel and the few-row GEMV at 2, 4, 8 and 16 rows on every matrix."
    for name, (O, I) in shapes.items():
        w, s = random_fp8(O, I, dev, g)
        nbytes = O * I + s.numel()
        n = copies_for(nbytes, smoke)
        wc, sc = [w] + [w.clone() for _ in range(n - 1)], [s] + [s.clone() for _ in range(n - 1)]
        for M in (2, 4) if smoke else (2, 4, 8, 16):
            x = torch.randn(M, I, device=dev, generator=g).bfloat16()
            ref = F8.fp8_linear_ref(x, w, s)
            sweep(res, name, "ship", M, lambda x, w, s, c: F8.fp8_linear_triton(x, w, s), [None], x, wc, sc, ref, nbytes, 1e9)
            blocks = I // 128
            cf = [(M, bn, sub, sp, wp) for bn in (16, 32) for sub in (1, 2, 4) for sp in (1, 2, 4, 8) for wp in (4, 8)
                  if blocks % (sp * sub) == 0 and (smoke or 66 <= -(-O // bn) * sp <= 800)][:2 if smoke else None]
            sweep(res, name, "gemv_rows", M, gemv_rows, cf, x, wc, sc, ref, nbytes, budget)
        save(res)


def save(res: dict) -> Path:
    "The record so far to $OUT/fp8_gemv.json (after every matrix: a run cut short keeps what it measured)."
    out = Path(os.environ.get("OUT", "/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_gemv.json").write_text(json.dumps(res, indent=1) + "\n")
    return out / "fp8_gemv.json"


if __name__ == "__main__":
    main()
