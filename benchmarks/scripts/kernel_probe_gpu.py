"""Probes for this session's kernel choices on the H200 (embedded model, bf16), each timed as 20 calls captured in a
CUDA graph: (1) the small-MoE kernel against the grouped path from 2 to 2,048 token-expert pairs on the target's
own stacks (where the bound should sit at 64 requests' 768-pair rounds); (2) the draft block attention at 1 and 64
requests, the shipped kernel against variants of its two products (bf16 tensor-core QKᵀ, tf32 or split-bf16 P·V,
warps); (3) the indexer's top-k of packed keys: torch.topk against a one-program-per-row bitonic sort.
OUT=. python kernel_probe_gpu.py"""
import json, os, torch, triton, triton.language as tl, dspark
import dspark.kernels.draft as kd
from round_profile_lib import graph_us
from dspark.tools.bench import machine
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.kernels.moe import small_moe_triton
from dspark.model.layers import MoE, routed_sync_free, stack_experts

OUT = os.environ["OUT"]
res = {"machine": machine()}


llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device="cuda", dtype="bfloat16", max_num_seqs=64,
                 max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
model, d = llm.runner.model, llm.runner.proposer.drafter
# 1. MoE
moe = next(m for m in model.modules() if isinstance(m, MoE))
st, k = stack_experts(moe), moe.gate.cfg.num_experts_per_tok
E, D = st.w2.shape[:2]
gen = torch.Generator().manual_seed(0)
rows = []
saved, moe.small = moe.small, None
for n in (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024):
    x = torch.randn(n, D, generator=gen).to("cuda", torch.bfloat16)
    idx = (torch.rand(n, E, generator=gen).argsort(-1)[:, :k] + moe.first).cuda()
    w = torch.rand(n, k, generator=gen).cuda()
    s = graph_us(lambda: small_moe_triton(x, w, idx, st.w13, st.w2, moe.first, moe.experts[0].limit))
    gr = graph_us(lambda: routed_sync_free(moe, x, w, idx))
    rows.append({"tokens": n, "pairs": n * k, "small_us": s, "grouped_us": gr})
    print("moe", rows[-1], flush=True)
moe.small = saved
res["moe"] = {"engine_bound_pairs": moe.small_pairs, "rows": rows}
json.dump(res, open(f"{OUT}/kernel_probe_gpu.json", "w"), indent=1)

# 2. block attention variants
@triton.jit
def _attn_var(q_ptr, s_qr, s_qt, s_qh, c_ptr, s_cr, s_cn, ok_ptr, s_okr, kv_ptr, s_kvr, s_kvt, sink_ptr,
              o_ptr, s_or, s_ot, s_oh, part_ptr, cnt_ptr, H, G, NC, NT, Dh, scale, BLOCK_Q: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr):
    r, qg, sp = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    QG = tl.num_programs(1)
    qi = qg * BLOCK_Q + tl.arange(0, BLOCK_Q)
    t, hh, dd = qi // H, qi % H, tl.arange(0, BLOCK_D)
    qm, dm = qi < G * H, dd < Dh
    q = tl.load(q_ptr + r * s_qr + t[:, None] * s_qt + hh[:, None] * s_qh + dd[None, :], mask=qm[:, None] & dm[None, :], other=0.0)
    if sp < NT:
        j = sp * BLOCK_N + tl.arange(0, BLOCK_N)
        ok = (j < NC) & (tl.load(ok_ptr + r * s_okr + j, mask=j < NC, other=0) != 0)
        keys = tl.load(c_ptr + r * s_cr + j[:, None] * s_cn + dd[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
    else:
        j = tl.arange(0, BLOCK_N)
        ok = j < G
        keys = tl.load(kv_ptr + r * s_kvr + j[:, None] * s_kvt + dd[None, :], mask=ok[:, None] & dm[None, :], other=0.0)
    if QK == 0: s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee") * scale
    else: s = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16))) * scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m = tl.maximum(tl.max(s, 1), -1e30)
    p = tl.exp(s - m[:, None])
    if PV == 0: acc = tl.dot(p, keys.to(tl.float32), input_precision="ieee")
    elif PV == 1: acc = tl.dot(p, keys.to(tl.float32), input_precision="tf32")
    else:
        hi = p.to(tl.bfloat16)
        lo = (p - hi.to(tl.float32)).to(tl.bfloat16)
        kb = keys.to(tl.bfloat16)
        acc = tl.dot(hi, kb) + tl.dot(lo, kb)
    W = BLOCK_Q * (BLOCK_D + 2)
    base = ((r * QG + qg) * (NT + 1) + sp) * W
    i = tl.arange(0, BLOCK_Q)
    tl.store(part_ptr + base + i, m)
    tl.store(part_ptr + base + BLOCK_Q + i, tl.sum(p, 1))
    tl.store(part_ptr + base + 2 * BLOCK_Q + i[:, None] * BLOCK_D + dd[None, :], acc)
    tl.debug_barrier()
    done = tl.atomic_add(cnt_ptr + r * QG + qg, 1, sem="acq_rel")
    if done == NT:
        m_i = tl.full([BLOCK_Q], -1e30, tl.float32)
        l_i = tl.zeros([BLOCK_Q], tl.float32)
        o = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
        row0 = (r * QG + qg) * (NT + 1) * W
        for kk in range(0, NT + 1):
            b = row0 + kk * W
            m_k = tl.load(part_ptr + b + i, cache_modifier=".cg")
            l_k = tl.load(part_ptr + b + BLOCK_Q + i, cache_modifier=".cg")
            a_k = tl.load(part_ptr + b + 2 * BLOCK_Q + i[:, None] * BLOCK_D + dd[None, :], cache_modifier=".cg")
            m_new = tl.maximum(m_i, m_k)
            alpha, beta = tl.exp(m_i - m_new), tl.exp(m_k - m_new)
            l_i = l_i * alpha + l_k * beta
            o = o * alpha[:, None] + a_k * beta[:, None]
            m_i = m_new
        sink = tl.load(sink_ptr + hh, mask=qm, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.exp(sink - m_new)
        o = o * (alpha / l_i)[:, None]
        tl.store(o_ptr + r * s_or + t[:, None] * s_ot + hh[:, None] * s_oh + dd[None, :], o, mask=qm[:, None] & dm[None, :])
        tl.atomic_xchg(cnt_ptr + r * QG + qg, 0)

def attn_var(q, ctx, valid, kv, sink, scale, QK, PV, warps, block_n=32):
    R, G, H, Dh = q.shape
    NC = ctx.shape[1]
    out = torch.empty(R, G, H, Dh, dtype=torch.float32, device=q.device)
    BLOCK_D, BLOCK_Q = 128, 32
    BLOCK_N = max(block_n, triton.next_power_of_2(G))
    QG, NT = triton.cdiv(G * H, BLOCK_Q), triton.cdiv(NC, BLOCK_N)
    part = torch.empty(R * QG * (NT + 1) * BLOCK_Q * (BLOCK_D + 2), dtype=torch.float32, device=q.device)
    _attn_var[(R, QG, NT + 1)](q, q.stride(0), q.stride(1), q.stride(2), ctx, ctx.stride(0), ctx.stride(1), valid,
        valid.stride(0), kv, kv.stride(0), kv.stride(1), sink, out, out.stride(0), out.stride(1), out.stride(2), part,
        kd._attn_counters(R * QG, q.device), H, G, NC, NT, Dh, scale, BLOCK_Q=BLOCK_Q, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, QK=QK, PV=PV, num_warps=warps)
    return out

cfg, attn = d.cfg, d.mtp[0].attn
res["attention"] = {}
for R in (1, 64):
    H, Dh, G = attn.attn_sink.shape[0], cfg.head_dim, d.block_size
    rnd = lambda *s: torch.randn(*s, generator=gen).cuda()
    q, ring, kv = rnd(R, G, H, Dh).bfloat16(), rnd(R, 133, Dh).bfloat16(), rnd(R, G, Dh).bfloat16()
    valid = (torch.rand(R, 133, generator=gen) < 0.95).cuda()
    sink, sc = attn.attn_sink, Dh ** -0.5
    ref = kd.draft_block_attention_ref(q, ring, valid, kv, sink, sc)
    row = {"shipped": graph_us(lambda: kd.draft_block_attention(q, ring, valid, kv, sink, sc)),
           "shipped_err": (kd.draft_block_attention(q, ring, valid, kv, sink, sc) - ref).abs().max().item()}
    for QK in (0, 1):
        for PV in (0, 1, 2):
            for warps in (2, 4, 8):
                for bn in (32, 64):
                    f = lambda: attn_var(q, ring, valid, kv, sink, sc, QK, PV, warps, bn)
                    row[f"qk{QK}_pv{PV}_w{warps}_n{bn}"] = [graph_us(f), (f() - ref).abs().max().item()]
    res["attention"][R] = row
    print("attention", R, json.dumps(row), flush=True)
    json.dump(res, open(f"{OUT}/kernel_probe_gpu.json", "w"), indent=1)

# 3. top-k of packed keys
@triton.jit
def _topk_sort(x_ptr, s_x, o_ptr, s_o, n, K, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + r * s_x + c, mask=c < n, other=0)
    x = tl.where(c < n, x, -9223372036854775807 - 1)
    x = tl.sort(x, descending=True)
    tl.store(o_ptr + r * s_o + c, (2147483647 - (x & 0xFFFFFFFF)).to(tl.int32), mask=c < K)

res["topk"] = []
for N in (1, 6, 64, 384):
    for n in (67, 256, 1024, 4096):
        K = min(32, n)
        s = torch.randn(N, n, generator=gen).cuda()
        bits = s.view(torch.int32).to(torch.int64)
        packed = (((bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32) | (2147483647 - torch.arange(n, device="cuda"))).contiguous()
        o = torch.empty(N, K, dtype=torch.int32, device="cuda")
        f = lambda: _topk_sort[(N,)](packed, packed.stride(0), o, o.stride(0), n, K, BLOCK=triton.next_power_of_2(n),
                                     num_warps=4 if n <= 1024 else 8)
        f()
        same = torch.equal(o.long(), torch.topk(packed, K, -1).indices)
        row = {"rows": N, "cols": n, "torch_us": graph_us(lambda: torch.topk(packed, K, -1)), "sort_us": graph_us(f), "same": same}
        res["topk"].append(row)
        print("topk", row, flush=True)
json.dump(res, open(f"{OUT}/kernel_probe_gpu.json", "w"), indent=1)

# 4. C64 decode, 128 greedy tokens: no-spec, then DSpark with the engine's small-MoE bound tried up to 256 pairs
# (the shipped search) and up to 2,048 (so a 64-request round's 768 pairs may take the kernel when it is faster)
del llm; torch.cuda.empty_cache()
import dspark.runtime.graphs as G
from dspark.tools.bench import _default_model_prompts, decode_run
from dspark.kernels.moe import small_moe_pairs
prompts = _default_model_prompts(DEFAULT_MODEL, 64, 128)
res["c64"] = []
for mode, most in (("none", 256), ("dspark", 256), ("dspark", 2048), ("none", 256), ("dspark", 2048), ("dspark", 256)):
    G.small_moe_pairs = lambda moe, most=most: small_moe_pairs(moe, most)
    r = decode_run(DEFAULT_MODEL, prompts, None if mode == "none" else mode, 5 if mode == "dspark" else None, 128,
                   "cuda", "bfloat16", repeats=3)
    r.pop("token_ids", None)
    res["c64"].append({"most": most, **r})
    print("c64", mode, most, r["tok_s"], r["tok_s_runs"], r["mean_acceptance_length"], flush=True)
    json.dump(res, open(f"{OUT}/kernel_probe_gpu.json", "w"), indent=1)
