"""The DSpark context ring written inside the captured step (`DSparkProposer.write_context`), checked on CPU by
standing in for the graphs: each bucket's "replay" reruns `forward_static` on the runner's persistent buffers,
which is exactly the work a captured graph records. The engine then skips `observe`; its drafts, acceptance and
tokens must equal the eager engine's, which observes committed positions only."""
import pytest
import torch

import dspark
from dspark.runtime.graphs import GraphRunner
from dspark.runtime.static import forward_static
from dspark.sample.sampling import SamplingParams


class EagerReplay:
    "A captured graph's stand-in: `replay()` reruns the step and copies into the outputs of the first run."
    def __init__(self, run, out):
        self.run, self.out, self.replays = run, out, 0

    def replay(self) -> None:
        new = self.run()
        self.replays += 1
        for name in ("logits", "features", "finals"):
            if getattr(self.out, name) is not None: getattr(self.out, name).copy_(getattr(new, name))


def emulate_graphs(llm, max_num_seqs: int, ragged_tokens: int = 0) -> GraphRunner:
    "The engine's GraphRunner with every bucket's graph (decode/verify, and ragged up to `ragged_tokens`) emulated."
    r, pr = llm.runner, llm.runner.proposer
    g = GraphRunner(r.model, r.cache, r.forward, max_num_seqs, r.cache.cc.lookahead, r.max_model_len,
                    taps=pr.taps if pr else (), finals=bool(pr and pr.final), capture=False,
                    context=getattr(pr, "write_context", None), ragged_tokens=ragged_tokens)
    for graphs, sizes, ragged in ((g.graphs, g.sizes, False), (g.ragged, g.ragged_sizes, True)):
        for n in sizes:
            g._pad_only(n)
            run = lambda n=n, ragged=ragged: g.run(n, ragged)
            rep = EagerReplay(run, run())
            graphs[n] = (rep, rep.out)
    r.forward = llm.graphs = g
    return g


def use_references(monkeypatch) -> None:
    "The kernels' torch references inside the emulated graphs: the plumbing is under test, not Triton."
    import dspark.runtime.static as G
    from dspark.kernels.attention import indexer_topk_ref, sparse_attention_ref
    from dspark.kernels.fused import qkv_rope_insert_ref
    def rope_insert_(q, *a, **k):                       # the kernel's contract: Q (and the K=V rows) rewritten in place
        out = qkv_rope_insert_ref(q, *a, **k); q.copy_(out[0])
        kv = a[3] if len(a) > 3 else k.get("kv")
        if kv is not None and out[1] is not None: kv.copy_(out[1])
        return out
    monkeypatch.setattr(G, "sparse_attention", sparse_attention_ref)
    monkeypatch.setattr(G, "indexer_topk", indexer_topk_ref)
    monkeypatch.setattr(G, "qkv_rope_insert_", rope_insert_)


@pytest.mark.parametrize("max_tokens", [24])
def test_in_graph_context_ring_matches_observe(tiny_ckpt, max_tokens, monkeypatch):
    use_references(monkeypatch)
    prompts = [list(range(5, 21)), list(range(30, 37))]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs, stats, drafts = [], [], []
    for emulate in (False, True):
        llm = dspark.LLM(tiny_ckpt, speculative="dspark", max_num_seqs=2, max_model_len=96,
                         kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
        if emulate:
            g = emulate_graphs(llm, 2)
            calls = []
            real = llm.runner.proposer.observe_many
            llm.runner.proposer.observe_many = lambda *a: (calls.append(a), real(*a))
        seen, propose = [], llm.runner.proposer.propose_greedy
        llm.runner.proposer.propose_greedy = lambda *a: seen.append(propose(*a)) or seen[-1]
        o = llm.generate(prompts, sp, use_tqdm=False)
        drafts.append(seen)
        outs.append([x.outputs[0].token_ids for x in o]); stats.append(llm.runner.stats)
    assert g.replays > 0 and len(calls) == g.eager_steps == 1   # only the (eager) prefill step updates the ring eagerly
    assert outs[0] == outs[1]
    assert drafts[0] == drafts[1] and len(drafts[1]) > 2          # the same drafts from the same context rows
    assert stats[0] == stats[1]


def test_ring_keeps_the_window_below_rejected_rows(tiny_ckpt):
    "Rows of positions at or past the anchor (rejected drafts) never displace the `w` positions below it."
    llm = dspark.LLM(tiny_ckpt, speculative="dspark", max_num_seqs=1, kv_cache_memory_bytes=16 * 2**20)
    ctx = llm.runner.proposer.ctx
    w, size = ctx.w, ctx.size
    D = llm.model.cfg.hidden_size * len(llm.runner.proposer.taps)
    feats = torch.randn(2 * w, D)
    ctx.claim(0, "a"); ctx.insert(0, feats[:w + 3], torch.arange(w + 3))        # committed 0..w+2
    P = w + 3
    before = [t.clone() for t in ctx.gather(0, P)]
    k = size - w                                                                 # a verify step's furthest reach
    ctx.insert_many(torch.zeros(k, dtype=torch.long), feats[P:P + k], torch.arange(P, P + k))   # then all rejected
    after = ctx.gather(0, P)
    assert all(torch.equal(torch.sort(a, 0).values, torch.sort(b, 0).values) for a, b in zip(before, after))
    assert len(after[0]) == w



@pytest.mark.parametrize("speculative", [None, "dspark", "mtp"])
def test_prefill_graphs_match_eager_prefill(tiny_ckpt, tmp_path, speculative, monkeypatch):
    """Every step replayed, prefill chunks included (ragged graphs): an 80-token prompt is longer than the
    compressor rings and the DSpark context ring (w + γ = 69), and a 96-token step budget makes the second prompt's
    prefill resume in a later step. Tokens, drafts and acceptance must equal the eager engine's."""
    use_references(monkeypatch)
    ckpt = dspark.make_tiny_checkpoint(tmp_path, seed=3, drafter="mtp") if speculative == "mtp" else tiny_ckpt
    prompts = [list(range(5, 85)), list(range(100, 131))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs, stats = [], []
    for emulate in (False, True):
        llm = dspark.LLM(ckpt, speculative=speculative, max_num_seqs=2, max_model_len=128, max_num_batched_tokens=96,
                         kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
        if emulate: g = emulate_graphs(llm, 2, ragged_tokens=96)
        o = llm.generate(prompts, sp, use_tqdm=False)
        outs.append([x.outputs[0].token_ids for x in o]); stats.append(llm.spec_stats() if speculative else None)
    ragged = sum(rep.replays for rep, _ in g.ragged.values())
    assert g.ragged_sizes == [16, 32, 48, 64, 96] and g.eager_steps == 0 and ragged >= 2   # both prefill steps replayed
    assert outs[0] == outs[1]
    assert stats[0] == stats[1]


def test_prefill_context_write_has_one_writer_per_ring_place(tiny_ckpt):
    """A prefill step's chunk may be longer than the context ring (w + γ): inside a graph the scatter of duplicate
    places has no order, so `write_context` must write only each request's newest ring-full."""
    llm = dspark.LLM(tiny_ckpt, speculative="dspark", max_num_seqs=2, kv_cache_memory_bytes=16 * 2**20)
    pr = llm.runner.proposer
    ctx, D = pr.ctx, llm.model.cfg.hidden_size * len(pr.taps)
    n = ctx.size + 30                                     # request 0: 0..n-1 in one step; request 1: 3 tokens
    pos = torch.cat([torch.arange(n), torch.arange(40, 43), torch.zeros(2, dtype=torch.long)])
    slots = torch.tensor([0] * n + [1] * 3 + [ctx.scratch] * 2)
    live = torch.tensor([True] * (n + 3) + [False] * 2)
    last = torch.tensor([n - 1] * n + [42] * 3 + [-1] * 2)
    seen = []
    real = ctx.insert_many
    ctx.insert_many = lambda s, f, p: (seen.append((s.clone(), p.clone())), real(s, f, p))
    for r in (0, 1): ctx.claim(r, f"r{r}")
    pr.write_context(slots, live, torch.randn(len(pos), D), pos, last)
    s, p = seen[0]
    places = [(int(a), int(b) % ctx.size) for a, b in zip(s, p) if a != ctx.scratch]
    assert len(places) == len(set(places)) == ctx.size + 3
    assert sorted(ctx.pos[0].tolist()) == list(range(n - ctx.size, n)) and sorted(ctx.pos[1].tolist())[-3:] == [40, 41, 42]


@pytest.mark.parametrize("how", ["graphs", "triton"])
def test_resumed_prefixes_match_the_reference(tiny_ckpt, how, monkeypatch):
    """Prefix-cache hits resume a prompt a few positions before its cached end: those positions are recomputed for
    the compressor rings, while their entries and window rows stay in the (shared) cached blocks. The ragged
    graphs (emulated) and the eager batched Triton forward run these steps with `compress_chunks_` and a per-token
    floor; tokens must equal the reference forward's, and the cached blocks must keep their bytes."""
    from dspark.engine.scheduler import block_hash
    if how == "graphs": use_references(monkeypatch)
    g = torch.Generator().manual_seed(7)
    base = torch.randint(2, 512, (130,), generator=g).tolist()              # two full 64-token blocks to hit
    prompts = [base + [7, 8, 9], base[:129] + torch.randint(2, 512, (6,), generator=g).tolist()]
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    runs = {}
    for backend in ("reference", how):
        llm = dspark.LLM(tiny_ckpt, max_num_seqs=2, max_model_len=256, kv_cache_memory_bytes=16 * 2**20,
                         attention_backend="reference" if backend != "triton" else "triton")
        if backend == "graphs": emu = emulate_graphs(llm, 2, ragged_tokens=256)
        outs = [llm.generate([base], sp, use_tqdm=False)[0].outputs[0].token_ids]
        kv, cache = llm.scheduler.kv, llm.runner.cache
        h0 = block_hash(None, base[:64]); hs = [h0, block_hash(h0, base[64:128])]
        blocks = [kv.comp.lookup(h) for h in hs]
        snap = lambda: [p[blocks].clone() for p in [*cache.entries.values(), *cache.index_keys.values()]]
        before = snap()
        outs += [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]   # one by one: hits
        assert all(torch.equal(a, b) for a, b in zip(before, snap())), "a resumed prefix rewrote its cached entries"
        runs[backend] = (outs, llm.prefix_cache_stats())
    assert runs[how] == runs["reference"]
    assert runs["reference"][1]["hits"] >= 2 * 64                  # both later prompts resumed a cached prefix
    if how == "graphs": assert emu.eager_steps == 0                 # the resumed steps replayed too


def test_prefill_graphs_on_an_fp8_cache(tiny_ckpt, monkeypatch):
    """Ragged graphs (emulated; attention by the kernels' references, the compressor by its Triton kernel) on an
    FP8 cache: the compressor entries are quantised by `store_entries` inside the step, in the prefill replay and in
    the decode replays after it. An 80-token prompt prefills in one replay; tokens equal the reference forward's."""
    use_references(monkeypatch)
    prompts = [list(range(5, 85))]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)   # decode steps read entries decode steps wrote
    outs = []
    for emulate in (False, True):
        llm = dspark.LLM(tiny_ckpt, max_num_seqs=1, max_model_len=96, kv_cache_dtype="fp8", kv_cache_memory_bytes=16 * 2**20,
                         enable_prefix_caching=False)
        if emulate: g = emulate_graphs(llm, 1, ragged_tokens=96)
        outs.append(llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0].token_ids)
    assert g.eager_steps == 0 and sum(rep.replays for rep, _ in g.ragged.values()) == 1
    assert outs[0] == outs[1]
