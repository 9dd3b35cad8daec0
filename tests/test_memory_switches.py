"""The working-memory switches (`config.WORKING_MEMORY`, mHC's three in `model.mhc`; chapter 22c): each one, turned
off, must change what is allocated -- a new tensor where the reduction writes over an old one or into a shared
buffer -- and nothing else: the engine's tokens with it off equal those with every switch on. The captured steps run
uncaptured on the CPU (`emulate_graphs`: each bucket's "replay" reruns the step on the persistent buffers, the work
a graph records), with the attention kernels' torch references; the in-place query is checked through the Triton
forward, whose fused kernel carries it (the interpreter, at a few tokens)."""
import os

import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import pytest

import dspark
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, forward_cached
from dspark.runtime.buffers import fill_buffers
from dspark.runtime.graphs import DraftGraphs, GraphRunner
from dspark.runtime.memory import MEMORY_REDUCTIONS, memory_reductions, reductions_set
from dspark.sample.sampling import SamplingParams
from test_graph_context import emulate_graphs, use_references

PROMPTS = [list(range(5, 21)), list(range(30, 37))]
KW = dict(max_num_seqs=2, max_model_len=96, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)


def storage(t: torch.Tensor) -> int: return t.untyped_storage().data_ptr()


def test_switches_are_all_on_by_default_and_restored():
    assert memory_reductions() == dict.fromkeys(MEMORY_REDUCTIONS, True) and len(MEMORY_REDUCTIONS) == 8
    with reductions_set(graph_draft_q=False, inplace_post=False) as on:
        assert not on["graph_draft_q"] and not on["inplace_post"] and on["fuse_final"]
    assert all(memory_reductions().values())
    with pytest.raises(KeyError, match="no working-memory switch"):
        with reductions_set(inplace_k=False): pass


def test_inplace_q_off_writes_a_new_query():
    from dspark.kernels.fused import qkv_rope_insert_
    g = torch.Generator().manual_seed(0)
    N, H, d = 3, 2, 16
    q, kv, w = torch.randn(N, H, d, generator=g), torch.randn(N, d, generator=g), torch.rand(d, generator=g) + 0.5
    cos, sin = torch.rand(N, 4, generator=g), torch.rand(N, 4, generator=g)
    q_on, kv_on = q.clone(), kv.clone()
    got_on = qkv_rope_insert_(q_on, cos, sin, 1e-6, kv_on, w)[0]
    assert got_on.data_ptr() == q_on.data_ptr()                              # on: over the projection
    q_off, kv_off, qi = q.clone(), kv.clone(), q.clone()
    with reductions_set(inplace_q=False):
        got_off = qkv_rope_insert_(q_off, cos, sin, 1e-6, kv_off, w)[0]
        got_i = qkv_rope_insert_(qi, cos, sin, 1e-6, q_norm=False)[0]        # RoPE only (the indexer's): not a Q head call
    assert storage(got_off) != storage(q_off) and torch.equal(q_off, q)     # off: a new tensor, the projection untouched
    assert torch.equal(got_off, got_on) and torch.equal(kv_off, kv_on)
    assert got_i.data_ptr() == qi.data_ptr()


@pytest.fixture(scope="module")
def own_model(tiny_ckpt):
    return dspark.load_target(tiny_ckpt)                # GraphRunner switches its MoE: not the shared fixture


def _verify_step(model, **kw):
    "A GraphRunner (uncaptured) and the bucket-4 step of one request's first 4 tokens, run as its graph would."
    cc = CacheConfig(block_size=16, num_blocks=12, num_window_blocks=12, max_seqs=2, lookahead=3)
    cache = PagedKVCache(model.cfg, cc)
    r = GraphRunner(model, cache, forward_cached, max_num_seqs=2, lookahead=3, max_model_len=80, capture=False, **kw)
    t = [0, 1, 2, 3, 4, 5]
    fill_buffers(r.buf, [torch.arange(3, 7)], [SeqView(t, t, 0, 0)], 4, cache.scratch_slot)
    return r, r.run(4)


def test_shared_logits_off_gives_each_graph_its_own_logits(own_model, monkeypatch):
    use_references(monkeypatch)
    on, a = _verify_step(own_model)
    assert a.logits.data_ptr() == on.logits.data_ptr()                       # on: a view of the one shared buffer
    with reductions_set(shared_logits=False):
        off, b = _verify_step(own_model)
    assert off.logits is None and storage(b.logits) != storage(on.logits)    # off: the step's own [n, V]
    assert b.logits.shape == (4, own_model.cfg.vocab_size) and torch.equal(b.logits, a.logits[:4])


def test_skip_mtp_staging_off_stages_the_final_streams(own_model, monkeypatch):
    use_references(monkeypatch)
    on, a = _verify_step(own_model)
    assert not on.finals and a.finals is None
    with reductions_set(skip_mtp_staging=False):
        off, b = _verify_step(own_model)
    cfg = own_model.cfg
    assert off.finals and b.finals.shape == (4, cfg.hc_mult, cfg.hidden_size)   # off: [n, hc, D] kept by the step
    assert torch.equal(b.logits, a.logits)
    off.graphs = {n: None for n in off.sizes}                                # pretend captured: eligibility only
    t = [0, 1, 2, 3, 4, 5]
    assert off.can_replay([torch.zeros(1, dtype=torch.long)], [SeqView(t, t, 0, 10)], (), None)   # a step without MTP


@pytest.fixture(scope="module")
def dspark_llm(tiny_ckpt):
    return dspark.LLM(tiny_ckpt, speculative="dspark", **KW)


def test_graph_draft_q_off_returns_each_buckets_distributions(dspark_llm):
    pr = dspark_llm.runner.proposer
    on = DraftGraphs(pr, 2, capture=False)
    assert len(on.sampled_graphs[False][2][1](2)) == 3                      # on: written into the proposer's store
    with reductions_set(graph_draft_q=False):
        off = DraftGraphs(pr, 2, capture=False)
    out = off.sampled_graphs[True][2][1](2)
    V = dspark_llm.model.cfg.vocab_size
    assert len(out) == 4 and out[3].shape == (2, pr.drafter.block_size, V) and storage(out[3]) != storage(pr.q)


def _tokens(ckpt, off: str | None) -> tuple[list, list]:
    "Greedy and seeded sampled tokens of a DSpark engine with emulated target and draft graphs, `off` switched off."
    with reductions_set(**({off: False} if off else {})):
        llm = dspark.LLM(ckpt, speculative="dspark", **KW)
        g = emulate_graphs(llm, 2)
        llm.runner.proposer.graphs = dg = DraftGraphs(llm.runner.proposer, 2, capture=False)
        run = lambda sp: [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        greedy = run(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        sampled = run(SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True))
    assert g.replays > 0 and dg.replays > 0                                  # the graph steps ran
    return greedy, sampled


@pytest.fixture(scope="module")
def all_on(tiny_ckpt):
    mp = pytest.MonkeyPatch()
    use_references(mp)
    try: yield _tokens(tiny_ckpt, None)
    finally: mp.undo()


@pytest.mark.parametrize("off", [n for n in MEMORY_REDUCTIONS if n != "inplace_q"])
def test_engine_tokens_equal_with_a_switch_off(tiny_ckpt, all_on, off, monkeypatch):
    use_references(monkeypatch)
    assert _tokens(tiny_ckpt, off) == all_on


def test_engine_tokens_equal_with_inplace_q_off(tiny_ckpt, monkeypatch):
    # the Triton forward (`attention_backend="triton"`), whose attention calls the fused kernel for every layer's
    # query heads; its sparse attention and indexer by their references, so the interpreter runs the kernel under test
    import dspark.kernels.fused as F
    from dspark.kernels.attention import indexer_topk_ref, sparse_attention_ref
    monkeypatch.setattr(F, "sparse_attention", sparse_attention_ref)
    monkeypatch.setattr(F, "indexer_topk", indexer_topk_ref)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = []
    for on in (True, False):
        with reductions_set(inplace_q=on):
            llm = dspark.LLM(tiny_ckpt, attention_backend="triton", **KW)
            out.append([o.outputs[0].token_ids for o in llm.generate([PROMPTS[1]], sp, use_tqdm=False)])
    assert out[0] == out[1]


def test_drafter_block_with_inplace_q_off(tiny_ckpt):
    # the DSpark drafter's fast path calls the same kernel for its query heads (`rope_kernel`): a new query, same block
    from dspark.kernels.fused import qkv_rope_insert_
    from dspark.model.drafter import load_drafter
    target = dspark.load_target(tiny_ckpt)
    drafter = load_drafter(tiny_ckpt, target)
    drafter.rope_kernel = qkv_rope_insert_
    cfg, gen = target.cfg, torch.Generator().manual_seed(2)
    rows = torch.randn(2, cfg.num_draft_stages, 5, cfg.head_dim, generator=gen)
    valid, anchors, P = torch.ones(2, 5, dtype=torch.bool), torch.tensor([3, 50]), torch.tensor([7, 30])
    on = drafter.block_hidden(anchors, P, rows, valid)
    with reductions_set(inplace_q=False):
        off = drafter.block_hidden(anchors, P, rows, valid)
    assert torch.equal(on, off)


def test_sampled_logits_runs_the_head_on_the_sampling_rows_alone(tiny_ckpt):
    """`sampled_logits`: in 8-token steps, a 16-token and a 7-token prompt's prefill chunks give the head only the rows
    that sample (one a request, at the prompt's end; none for a chunk short of it), where with the switch off it reads
    every row of the step; the tokens are the same."""
    got = []
    for on in (True, False):
        with reductions_set(sampled_logits=on):
            llm = dspark.LLM(tiny_ckpt, max_num_batched_tokens=8, **KW)
            rows: list[int] = []
            hook = llm.model.head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[-2]))
            sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            got.append(([o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)], rows))
            hook.remove()
    (on_tokens, on_rows), (off_tokens, off_rows) = got
    assert on_tokens == off_tokens
    assert max(on_rows) <= 2 and 0 in on_rows and max(off_rows) == 8
