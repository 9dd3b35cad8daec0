"""CUDA-graph step plumbing that a CPU can check: bucket sizes, which steps a graph may replay (and that the rest
fall back to the eager forward with identical results), the engine and server switches. The fixed-shape step
itself is checked against the reference in nbs/22_cuda_graphs; capture and replay need a GPU (.devrun GPU runs,
recorded in benchmarks/records/graphs_gpu.json)."""
import pytest
import torch

import dspark
from dspark.runtime.graphs import GraphRunner, bucket_sizes
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, forward_cached


def test_bucket_sizes_cover_every_count_with_bounded_padding():
    for top in (1, 6, 16, 96, 384):
        sizes = bucket_sizes(top)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == top
        for n in range(1, top + 1):
            b = next(s for s in sizes if s >= n)
            assert b - n <= max(8, n // 2)            # a bucket never more than ~1.5x the step (or 8 rows)


@pytest.fixture(scope="module")
def own_model(tiny_ckpt):
    return dspark.load_target(tiny_ckpt)                # GraphRunner switches its MoE: not the shared fixture


@pytest.fixture(scope="module")
def runner(own_model):
    tiny_model = own_model
    cc = CacheConfig(block_size=16, num_blocks=12, num_window_blocks=12, max_seqs=2, lookahead=3)
    cache = PagedKVCache(tiny_model.cfg, cc)
    calls = []
    def eager(*a, **kw):                              # the runner passes its fused mHC functions as `mhc`
        calls.append(a); return forward_cached(*a, **kw)
    r = GraphRunner(tiny_model, cache, eager, max_num_seqs=2, lookahead=3, max_model_len=80, capture=False)
    r.graphs = {n: None for n in r.sizes}              # pretend captured: only the eligibility rules are under test
    return r, cache, calls


def test_which_steps_a_graph_may_replay(runner):
    r, cache, _ = runner
    one, four, five = (torch.zeros(n, dtype=torch.long) for n in (1, 4, 5))
    view = lambda start, pooled=0: SeqView([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], 0, start, pooled)
    assert r.max_tokens == 2 * 4 and r.sizes[-1] == 8
    assert r.can_replay([one, four], [view(10), view(20)], (), None)          # decode + verify (1 + lookahead)
    assert not r.can_replay([five], [view(10)], (), None)                     # more than 1 + lookahead: prefill
    assert not r.can_replay([one], [view(10, pooled=16)], (), None)           # a cached prefix still pooling
    assert not r.can_replay([one, one, one], [view(1), view(2), view(3)], (), None)   # more requests than rows
    assert not r.can_replay([one], [view(10)], (2,), [])                      # taps/finals it was not captured with
    assert not r.can_replay([one], [view(84)], (), None)                      # past max_model_len + lookahead
    with dspark.batch_invariant():
        assert not r.can_replay([one], [view(10)], (), None)


def test_ineligible_steps_run_eagerly(runner, own_model):
    r, cache, calls, tiny_model = *runner, own_model
    prompt = torch.arange(3, 40)
    out = r(tiny_model, cache, [prompt], [SeqView([0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5], 0, 0)])
    assert len(calls) == 1 and r.eager_steps == 1 and out[0].shape == (37, tiny_model.cfg.vocab_size)


def test_engine_and_server_switches(tiny_ckpt):
    llm = dspark.LLM(tiny_ckpt, max_num_seqs=2, kv_cache_memory_bytes=16 * 2**20)
    assert llm.graphs is None                                                   # CPU: nothing to capture
    assert llm._use_graphs("cuda", "auto", False, False) and not llm._use_graphs("cuda", "auto", False, True)
    assert not llm._use_graphs("cuda", "reference", False, False) and not llm._use_graphs("cuda", "auto", True, False)
    from dspark.entrypoints.serve import parse_args
    assert parse_args(["--model", str(tiny_ckpt), "--enforce-eager"]).enforce_eager


def test_fill_buffers_lays_out_every_token_as_the_per_token_rule_says():
    """The vectorised host layout of a step against the rule written token by token, on random ragged steps; each
    step three times: laid out, again unchanged (the block tables are not resent), then with a block of a window
    table changed in place (they are)."""
    import random
    from dspark.runtime.buffers import StepBuffers, fill_buffers
    rng = random.Random(0)

    def check(buf, seqs, chunks, n, bs):
        fill_buffers(buf, chunks, seqs, n, 99)
        buf.unpack(n)                                  # what a captured step does first
        k = 0
        for i, (s, c) in enumerate(zip(seqs, chunks)):
            for j, tok in enumerate(c.tolist()):
                p = s.start + j
                want = (i, p, s.window_table[p // bs] * bs + p % bs if p >= s.pooled_upto else -1, s.slot,
                        s.start + len(c) - 1, s.pooled_upto, tok)
                got = tuple(int(getattr(buf, f)[k]) for f in ("tok_req", "tok_pos", "slots", "ring_slot", "last", "pooled", "ids"))
                assert got == want, (i, j, got, want)
                k += 1
            assert buf.window_tables[i, :len(s.window_table)].tolist() == s.window_table
            assert (buf.window_tables[i, len(s.window_table):] == -1).all() and (buf.tables[i, len(s.table):] == -1).all()
            assert buf.tables[i, :len(s.table)].tolist() == s.table
        for f, pad in (("tok_req", -1), ("tok_pos", -1), ("slots", -1), ("ring_slot", 99), ("last", -1), ("pooled", 0), ("ids", 0)):
            assert (getattr(buf, f)[k:n] == pad).all(), f

    for _ in range(200):
        bs, R, W, C, n_max = rng.choice([4, 16, 64]), rng.randint(1, 10), 8, 12, 256
        seqs, chunks = [], []
        for i in range(R):
            L = rng.randint(1, 20)
            start = rng.randint(0, bs * W - L - 1)
            wt = [rng.randint(0, 500) for _ in range((start + L - 1) // bs + 1)]
            seqs.append(SeqView(wt, [rng.randint(0, 500) for _ in range(rng.randint(0, C))], rng.randint(0, 30), start,
                                rng.choice([0, start, start + L // 2, 10 ** 6])))
            chunks.append(torch.randint(0, 100, (L,)))
        n = sum(len(c) for c in chunks) + rng.randint(0, 9)
        buf = StepBuffers.allocate(n_max, 16, bs * C - 1, bs, "cpu")
        check(buf, seqs, chunks, n, bs)
        sent = buf.stage.host["tables"].clone()
        buf.stage.host["tables"][:R] = 12345                # a resend would carry this: the unchanged step must not
        check(buf, seqs, chunks, n, bs)
        buf.stage.host["tables"].copy_(sent)
        seqs[-1].window_table[-1] = (seqs[-1].window_table[-1] + 7) % 500   # the engine grows its lists in place
        check(buf, seqs, chunks, n, bs)
    with pytest.raises(IndexError, match="past its window table"):
        fill_buffers(buf, [torch.zeros(3, dtype=torch.long)], [SeqView([1], [], 0, 100, 0)], 3, 99)


def test_one_gemm_for_the_x_projections_changes_no_logit(tiny_ckpt):
    # the fast path stacks each layer's x-reading projections (wq_a, wkv, the compressors', the indexer weights):
    # a decode step through forward_static gives the same logits before and after, the weights are views
    from dspark.runtime.buffers import fill_buffers
    from dspark.runtime.static import x_linears
    from dspark.model.layers import STACK, stack_linears
    from dspark.kernels.hc import aten_launches
    m = dspark.load_target(tiny_ckpt, device="cuda" if torch.cuda.is_available() else "cpu")
    for mod in m.modules():                          # 2 of the 18 entries: the indexer's scores decide which
        if hasattr(mod, "cfg"): mod.cfg.index_topk = 2
    cc = CacheConfig(block_size=16, num_blocks=12, num_window_blocks=12, max_seqs=2, lookahead=3)
    cache = PagedKVCache(m.cfg, cc, device=m.embed.weight.device)
    r = GraphRunner(m, cache, forward_cached, max_num_seqs=2, lookahead=3, max_model_len=80, capture=False)
    for blk in m.layers: blk.attn.__dict__.pop(STACK, None)         # on a GPU the runner stacked them already
    tables = [0, 1, 2, 3, 4, 5]
    with torch.no_grad():
        # a 71-token prefill, then position 71, which completes a CSA (ratio 4) and an HCA (ratio 16) entry
        forward_cached(m, cache, [torch.arange(3, 74, device=r.buf.ids.device)], [SeqView(tables, tables, 0, 0)])
        def tensors(v):                              # every cache tensor: window, entries, keys, rings
            if isinstance(v, torch.Tensor): return [v]
            if isinstance(v, dict): return tensors(list(v.values()))
            return [t for e in v for t in tensors(e)] if isinstance(v, (list, tuple)) else []
        live = tensors(list(vars(cache).values()))
        start = [t.clone() for t in live]
        def decode(static=True):                     # from the same cache state each time: logits, then the cache
            for t, t0 in zip(live, start): t.copy_(t0)
            if not static:                           # the reference step
                return [forward_cached(m, cache, [torch.tensor([11], device=r.buf.ids.device)],
                                       [SeqView(tables, tables, 0, 71)])[0]] + \
                       [t.clone() for t in live]
            fill_buffers(r.buf, [torch.tensor([11], device=r.buf.ids.device)], [SeqView(tables, tables, 0, 71)], 1,
                         cache.scratch_slot)
            return [r.run(1).logits[:1].clone()] + [t.clone() for t in live]
        reference = decode(static=False)
        state = {k: v.clone() for k, v in m.state_dict().items()}
        before = decode()
        assert len(before) > 20
        mm_before = aten_launches(decode)["mm"]
        kinds = set()
        for blk in m.layers:
            assert stack_linears(blk.attn, x_linears(blk.attn))
            (W, _, _), = blk.attn.__dict__[STACK][0]       # one kind: the tiny model's linears are all bf16
            ls = x_linears(blk.attn)
            assert ls[0].weight.data_ptr() == W.data_ptr() and W.shape[0] == sum(l.weight.shape[0] for l in ls)
            kinds.add(len(ls))
        assert kinds == {2, 4, 7}                    # sliding, HCA and CSA layers all covered by the tiny preset
        assert all(torch.equal(v, state[k]) for k, v in m.state_dict().items())
        after = decode()
        fewer = sum(n - 1 for n in (len(x_linears(b.attn)) for b in m.layers))
        assert aten_launches(decode)["mm"] == mm_before - fewer
        blk = m.layers[2]                            # a replaced weight: the stack is stale, dropped, not used
        blk.attn.wkv.weight = torch.nn.Parameter(blk.attn.wkv.weight.detach().clone())
        stale = decode()
        assert STACK not in blk.attn.__dict__
    for a, b, ref in zip(stale, before, reference): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b, ref in zip(after, before, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b, ref, rtol=1e-4, atol=1e-4)    # each projection reaches its place


def test_the_sps_profile_steps_carry_distinct_tokens(runner):
    """Capacity control's SPS curve times all-padding replays; their rows carry distinct token ids, so a mixture of
    experts routes them as it routes a real verify step's (one id everywhere sent every row to the same experts and
    priced a many-token step at V4-Flash width like a one-token one)."""
    r, _, _ = runner
    seen = []
    class Replay:                                      # stands in for a captured graph: what would it read?
        def replay(self): seen.append((r.buf.ids[:8].clone(), r.buf.tok_req[:8].clone()))
    saved, r.graphs = r.graphs, {8: (Replay(), None)}
    try: r.step_ms(8, reps=2)
    finally: r.graphs = saved
    ids, req = seen[-1]
    assert len(set(ids.tolist())) >= 6 and (req == -1).all()    # varied tokens, every row still padding
