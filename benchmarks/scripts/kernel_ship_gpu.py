"""The two kernels this session ships, timed on the H200 as 20 calls captured in a CUDA graph (median of 7 replays),
each next to the path it replaces in the same process: (1) the draft block attention at 1 and 64 requests of the
embedded drafter's shape (γ = 5, 4 heads of 128, a 133-row ring), bf16 inputs on the tensor-core path against the
same inputs in fp32 (the ieee path the bf16 ones took before); (2) the indexer top-k over 1..1,024-entry rows,
the per-token sort against torch.topk plus masking (`SORT_TOPK_COLS = 0`), with the indices compared.
OUT=. python kernel_ship_gpu.py"""
import json, os, torch
import dspark.kernels.attention as ka
import dspark.kernels.draft as kd
from round_profile_lib import graph_us
from dspark.tools.bench import machine
from dspark.kernels.attention import SeqView, batch_meta

OUT = os.environ["OUT"]
res = {"machine": machine(), "attention": [], "topk": []}
gen = torch.Generator().manual_seed(0)

for R in (1, 64):
    rnd = lambda *s: torch.randn(*s, generator=gen).cuda()
    q, ring, kv = rnd(R, 5, 4, 128), rnd(R, 133, 128), rnd(R, 5, 128)
    valid, sink, sc = (torch.rand(R, 133, generator=gen) < 0.95).cuda(), rnd(4), 128 ** -0.5
    bf = [t.bfloat16() for t in (q, ring, kv)]
    wide = [t.float() for t in bf]                                  # the same values, on the fp32 (ieee) path
    ref = kd.draft_block_attention_ref(*bf[:2], valid, bf[2], sink, sc)
    row = {"requests": R,
           "bf16_tensor_core_us": graph_us(lambda: kd.draft_block_attention(*bf[:2], valid, bf[2], sink, sc)),
           "fp32_ieee_us": graph_us(lambda: kd.draft_block_attention(*wide[:2], valid, wide[2], sink, sc)),
           "bf16_err": (kd.draft_block_attention(*bf[:2], valid, bf[2], sink, sc) - ref).abs().max().item(),
           "fp32_err": (kd.draft_block_attention(*wide[:2], valid, wide[2], sink, sc) - ref).abs().max().item()}
    res["attention"].append(row)
    print("attention", row, flush=True)

for N in (1, 6, 64, 384):                     # decode at 1 / verify at 1 (K + 1 = 6) / decode at 64 / verify at 64
    for n_cols in (16, 67, 256, 1024):
        bs, ratio, HI, DI = 256, 4, 8, 64
        ctx = n_cols * ratio
        per = -(-ctx // bs)
        seqs = [SeqView(window_table=list(range(i * per, (i + 1) * per)), table=list(range(i * per, (i + 1) * per)),
                        slot=i, start=ctx - 1) for i in range(N)]
        meta = batch_meta(seqs, [1] * N, bs, device="cuda")
        keys = torch.randn(N * per, bs // ratio, DI, generator=gen).cuda().bfloat16()
        q, w = torch.randn(N, HI, DI, generator=gen).cuda().bfloat16(), torch.randn(N, HI, generator=gen).cuda()
        f = lambda: ka.indexer_topk(q, w, keys, meta, ratio, DI ** -0.5, 512)
        sort_idx, sort_us = f(), graph_us(f)
        ka.SORT_TOPK_COLS = 0
        torch_idx, torch_us = f(), graph_us(f)
        ka.SORT_TOPK_COLS = 1024
        row = {"tokens": N, "cols": n_cols, "sort_us": sort_us, "torch_us": torch_us,
               "same": torch.equal(sort_idx, torch_idx)}
        res["topk"].append(row)
        print("topk", row, flush=True)
json.dump(res, open(f"{OUT}/kernel_ship_gpu.json", "w"), indent=1)
