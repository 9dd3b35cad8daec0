"forward_batched (batched compressors) against forward_cached on the GPU: prefill chunks longer than the rings, then a mixed step."
import copy, tempfile, torch, dspark
from dspark.kernels.fused import forward_batched
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, forward_cached
ck = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), seed=0)
oracle = {}
for dtype in ("float32", "bfloat16"):
    model = dspark.load_target(ck, device="cuda", dtype=dtype); cfg = model.cfg
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(cfg, CacheConfig(block_size=16, num_blocks=96, num_window_blocks=96, max_seqs=4, lookahead=8,
                                          dtype=model.embed.weight.dtype), device="cuda")
    tables = [list(range(24 * i, 24 * i + 24)) for i in range(4)]
    fast, ref = cache, copy.deepcopy(cache)
    views = lambda st: [SeqView(t, t, slot=i, start=s) for i, (t, s) in enumerate(zip(tables, st))]
    lens = [45, 90, 20, 300]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).cuda() for n in lens]
    errs = []
    with torch.no_grad():
        a = forward_batched(model, fast, prompts, views([0] * 4)); b = forward_cached(model, ref, prompts, views([0] * 4))
        errs.append(max((u - v).abs().max().item() for u, v in zip(a, b)))
        if dtype == "float32": oracle["prefill"] = [v.float() for v in b]
        else:
            o = oracle["prefill"]
            print("vs fp32 oracle, prefill logits: batched", max((u.float() - w).abs().max().item() for u, w in zip(a, o)),
                  "reference", max((v.float() - w).abs().max().item() for v, w in zip(b, o)), flush=True)
        nxt = [torch.randint(0, cfg.vocab_size, (n,), generator=g).cuda() for n in (1, 5, 40, 2)]
        a = forward_batched(model, fast, nxt, views(lens)); b = forward_cached(model, ref, nxt, views(lens))
        errs.append(max((u - v).abs().max().item() for u, v in zip(a, b)))
        same_top = all(torch.equal(u.argmax(-1), v.argmax(-1)) for u, v in zip(a, b))
    ring_err = max((fast.rings[k][j][:4] - ref.rings[k][j][:4]).abs().max().item() for k in fast.rings for j in (0, 1))
    ent_err = max((fast.entries[k].float() - ref.entries[k].float()).abs().max().item() for k in fast.entries)
    print("batched_check", dtype, "logit max abs err prefill/mixed", [f"{e:.2e}" for e in errs], "argmax equal", same_top,
          f"rings {ring_err:.2e} entries {ent_err:.2e}", flush=True)
