"""Why the drafter's block attention takes ~16 µs a launch at one request (chapter 17; round_anatomy_moe.json): the
split kernel at its launch settings and others, and a one-program-per-query-group variant that walks the context
tiles itself (online softmax, no partials, no merge), at the embedded drafter's shapes (γ = 5 rows, 4 heads of 128,
133 ring rows) for R = 1, 4, 16, 64. Each figure: median µs a launch over CUDA-graph replays of 20 launches.
The looping kernel lost at every R (10.7 µs against the split kernel's 7.1 at one request, block_attn_gpu.json) and
was not kept; without it the script times the split kernel's settings only.
OUT=. python block_attn_gpu.py"""
import json, os, statistics, torch, triton
import dspark.kernels.draft as KD
from dspark.kernels.hc import launch
from dspark.model.drafter import block_attention

OUT = os.environ.get("OUT", ".")
dev = "cuda"
G, H, Dh, NC = 5, 4, 128, 133

def split(q, ctx, valid, kv, sink, scale, BLOCK_N=64, warps=8):
    R = q.shape[0]
    BLOCK_D, BLOCK_Q, tc = 128, 32, True
    QG, NT = triton.cdiv(G * H, BLOCK_Q), triton.cdiv(NC, BLOCK_N)
    out = torch.empty(R, G, H, Dh, dtype=torch.float32, device=dev)
    part = torch.empty(R * QG * (NT + 1) * BLOCK_Q * (BLOCK_D + 2), dtype=torch.float32, device=dev)
    cnt = KD._attn_counters(R * QG, q.device)
    def go():
        launch(KD._block_attn_kernel, (R, QG, NT + 1), q, q.stride(0), q.stride(1), q.stride(2), ctx, ctx.stride(0),
                ctx.stride(1), valid, valid.stride(0), kv, kv.stride(0), kv.stride(1), sink, out, out.stride(0),
                out.stride(1), out.stride(2), part, cnt, H, G, NC, NT, Dh, scale, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N,
                BLOCK_D=BLOCK_D, TC=tc, WIDEN=False, num_warps=warps)
    return go, out

def loop(q, ctx, valid, kv, sink, scale, BLOCK_N=64, warps=4):
    R = q.shape[0]
    out = torch.empty(R, G, H, Dh, dtype=torch.float32, device=dev)
    if not hasattr(KD, "_block_attn_loop_kernel"): return None, out
    QG, NT = triton.cdiv(G * H, 32), triton.cdiv(NC, BLOCK_N)
    def go():
        launch(KD._block_attn_loop_kernel, (R, QG), q, q.stride(0), q.stride(1), q.stride(2), ctx, ctx.stride(0),
                ctx.stride(1), valid, valid.stride(0), kv, kv.stride(0), kv.stride(1), sink, out, out.stride(0),
                out.stride(1), out.stride(2), H, G, NC, NT, Dh, scale, BLOCK_Q=32, BLOCK_N=BLOCK_N, BLOCK_D=128,
                TC=True, WIDEN=False, num_warps=warps)
    return go, out

def time_us(go, n=20, reps=30):
    go(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        go(); torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(n): go()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(1000 * a.elapsed_time(b) / n)
    return round(statistics.median(ts), 2)

res = {"gpu": torch.cuda.get_device_name(), "shapes": dict(G=G, H=H, Dh=Dh, NC=NC), "rows": []}
torch.manual_seed(0)
for R in (1, 4, 16, 64):
    S = 2
    ring = torch.randn(R, S, NC, Dh, device=dev, dtype=torch.bfloat16)
    ctx = ring[:, 0]
    valid = torch.zeros(R, NC, dtype=torch.bool, device=dev); valid[:, :128] = True
    q = torch.randn(R, G, H, Dh, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(R, G, Dh, device=dev, dtype=torch.bfloat16)
    sink = torch.randn(H, device=dev, dtype=torch.float32)
    scale = Dh ** -0.5
    ref = block_attention(q, ctx, valid, kv, sink, scale).float()
    row = {"R": R}
    for name, (fn, kw) in {"split_n64_w8 (shipped)": (split, {}), "split_n64_w4": (split, dict(warps=4)),
                           "split_n128_w8": (split, dict(BLOCK_N=128)), "split_n128_w4": (split, dict(BLOCK_N=128, warps=4)),
                           "split_n256_w8": (split, dict(BLOCK_N=256)), "loop_n64_w4": (loop, {}),
                           "loop_n64_w8": (loop, dict(warps=8)), "loop_n128_w4": (loop, dict(BLOCK_N=128)),
                           "loop_n128_w8": (loop, dict(BLOCK_N=128, warps=8)), "loop_n32_w4": (loop, dict(BLOCK_N=32))}.items():
        try:
            go, out = fn(q, ctx, valid, kv, sink, scale, **kw)
            if go is None: continue
            us = time_us(go)
            go(); torch.cuda.synchronize()
            row[name] = {"us": us, "max_err": float((out - ref).abs().max())}
        except Exception as e:                      # a setting that does not compile is a finding too
            row[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    go = lambda: KD.draft_block_attention(q, ctx, valid, kv, sink, scale)
    row["draft_block_attention (API)"] = {"us": time_us(go)}
    print(json.dumps(row), flush=True)
    res["rows"].append(row)
json.dump(res, open(f"{OUT}/block_attn_gpu.json", "w"), indent=1)
