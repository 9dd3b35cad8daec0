"""The fused DSpark round (chapter 23) on CPU: device-side greedy acceptance against the host's `greedy_verify`, when
a step may run as a round, and an engine whose verify steps run as rounds (each round graph's "replay" reruns its
recorded work eagerly, as in test_graph_context) producing the same tokens, acceptance and drafts as the eager
engine. Capture and replay themselves run on the GPU (.devrun, benchmarks/records/graphs_gpu.json)."""
import pytest
import torch

import dspark
from dspark.runtime.runner import greedy_verify
from dspark.kernels.round import greedy_accept
from dspark.runtime.fused_round import RoundGraphs, simulate_matches
from dspark.runtime.graphs import GraphRunner
from dspark.cache.kv_cache import SeqView
from dspark.sample.sampling import SamplingParams
from test_graph_context import emulate_graphs


def test_greedy_accept_matches_greedy_verify():
    g = torch.Generator().manual_seed(1)
    seen = set()
    for trial in range(300):
        counts = torch.randint(0, 6, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g)
        first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), counts[:-1] + 1]), 0)
        N = int((counts + 1).sum()) + 3 * (trial % 2)                     # padding rows at the end, or none
        top, ids = torch.randint(0, 2, (N,), generator=g), torch.randint(0, 2, (N,), generator=g)
        a = greedy_accept(top, ids, first, counts, 6)
        for i, (f, k) in enumerate(zip(first.tolist(), counts.tolist())):
            want, toks = greedy_verify(ids[f + 1:f + 1 + k].tolist(), top[f:f + k + 1].tolist())
            assert int(a[i]) == want and toks[-1] == int(top[f + want])
            seen.add((want == 0, want == k))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}   # none, some, all accepted


def test_simulate_matches_draws_the_rule():
    """Simulated acceptance drawn inside a round: greedy acceptance after `simulate_matches` takes a geometric number of
    each request's drafts (P(at least j) = p^j, capped at its drafts), the counts it returns, then the target's own
    choice, which the rewrite leaves as it was; padding requests and rows past the accepted ones are untouched.
    Targets and drafts come from disjoint ranges here, so no target matches a draft by chance."""
    from dspark.runtime.runner import acceptance_probability
    torch.manual_seed(0)
    K, W, R = 5, 6, 4000
    counts = torch.randint(0, K + 1, (R,)); counts[::7] = K; counts[-3:] = 0        # the last three: padding
    first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), counts[:-1] + 1]), 0)
    N = int((counts + 1).sum())
    for p in (0.0, 0.55, 1.0):
        top, ids = torch.randint(100, 200, (N + R,)), torch.randint(0, 100, (N,))
        before = top.clone()
        caps = simulate_matches(top, ids, first, counts, W, p)
        a = greedy_accept(top[:N], ids, first, counts, W)
        assert torch.equal(greedy_accept(top[:N], ids, first, caps, W), a) and torch.equal(caps, a)
        assert (a <= counts).all() and (a[-3:] == 0).all()
        changed = (top[:N] != before[:N]).nonzero().flatten().tolist()
        assert changed == sorted(int(f) + j for f, k in zip(first, a) for j in range(int(k)))   # exactly the accepted rows
        assert torch.equal(top[first + a], before[first + a])                    # the target's choice after them
        full = a[counts == K].double()
        if p in (0.0, 1.0): assert (full == K * p).all()
        else:
            pmf = torch.tensor([p ** j * (1 - p) for j in range(K)] + [p ** K], dtype=torch.double)
            mean, sd = (pmf * torch.arange(K + 1)).sum(), ((pmf * (torch.arange(K + 1) - (pmf * torch.arange(K + 1)).sum()) ** 2).sum()).sqrt()
            assert abs(full.mean() - mean) <= 5 * sd / len(full) ** 0.5
    assert acceptance_probability(1 + 0.55 + 0.55 ** 2 + 0.55 ** 3 + 0.55 ** 4 + 0.55 ** 5, K) == pytest.approx(0.55)


class RoundReplay:
    "A captured round's stand-in: `replay()` reruns the round's work and copies into the first run's outputs."
    def __init__(self, rounds: RoundGraphs, R: int):
        self.rounds, self.R = rounds, R
        rounds._pad_only(R)
        self.out = rounds.run(R)

    def replay(self) -> None:
        new = self.rounds.run(self.R)
        for name in ("verified", "drafted", "conf", "following"): getattr(self.out, name).copy_(getattr(new, name))


def emulate_rounds(llm) -> RoundGraphs:
    g = emulate_graphs(llm, llm.runner.cache.cc.max_seqs)
    rounds = RoundGraphs(g, llm.runner.proposer, capture=False, simulated=llm.runner.simulated)
    for R in rounds.sizes:
        stand_in = RoundReplay(rounds, R)
        rounds.graphs[R] = (stand_in, stand_in.out)
    g.rounds = rounds
    return rounds


@pytest.fixture
def reference_kernels(monkeypatch):
    "The attention kernels' torch references (as in test_graph_context): the round's plumbing is under test."
    import dspark.runtime.static as G
    from dspark.kernels.attention import indexer_topk_ref, sparse_attention_ref
    from dspark.kernels.fused import qkv_rope_insert_ref
    def rope_insert_(q, *a, **k):
        out = qkv_rope_insert_ref(q, *a, **k); q.copy_(out[0]); return out
    monkeypatch.setattr(G, "sparse_attention", sparse_attention_ref)
    monkeypatch.setattr(G, "indexer_topk", indexer_topk_ref)
    monkeypatch.setattr(G, "qkv_rope_insert_", rope_insert_)


def test_fused_rounds_match_the_eager_engine(reference_kernels):
    """The trained default model, whose drafter gets drafts accepted: rounds end with none, some and all accepted.
    γ = 3 of the drafter's 5: a round's drafts are cut to the engine's depth (and to what max_tokens leaves)."""
    from dspark.tools.capacity_sweep import sweep_prompts
    from dspark.model.checkpoint import DEFAULT_MODEL
    prompts = [p[:n] for p, n in zip(sweep_prompts(DEFAULT_MODEL, 3, 40), (40, 23, 31))]   # held-out Python source
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (22, 9, 17)]   # rooms shrink at the end
    outs, stats, drafts = [], [], []
    for fused in (False, True):
        llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=3, max_num_seqs=3, max_model_len=128,
                         kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
        if fused: rounds = emulate_rounds(llm)
        seen, schedule = [], llm.scheduler.schedule
        def spy(schedule=schedule, seen=seen):                 # the drafts each step verifies (a round's are taken late)
            batch = schedule()
            seen.append({r.request_id: list(r.drafts) for r, _ in batch}); return batch
        llm.scheduler.schedule = spy
        o = llm.generate(prompts, sp, use_tqdm=False)
        outs.append([x.outputs[0].token_ids for x in o]); stats.append(llm.runner.stats); drafts.append(seen)
    assert rounds.replays > 3 and llm.graphs.eager_steps >= 1                 # prefills ran eagerly, rounds the rest
    assert outs[0] == outs[1] and [len(t) for t in outs[1]] == [22, 9, 17]
    s = stats[1]
    assert stats[0] == s and 0 < s.num_accepted_tokens < s.num_draft_tokens and s.accepted_per_position[-1] > 0
    assert drafts[0] == drafts[1]                                              # the same drafts after every step
    # a request aborted while its round's drafts are still on the GPU: the others are unaffected
    ids = [llm.add_request(p, q, request_id=f"again-{i}") for i, (p, q) in enumerate(zip(prompts, sp))]
    for _ in range(3): llm.step()
    assert llm.runner.deferred is not None and llm.abort_request(ids[1])
    while llm.has_unfinished_requests(): llm.step()
    assert [llm.pop_output(ids[i]).outputs[0].token_ids for i in (0, 2)] == [outs[0][0], outs[0][2]]


@pytest.mark.parametrize("mode", ["dspark", "mtp"])
def test_fused_rounds_draw_simulated_acceptance(reference_kernels, mode):
    """Under simulated acceptance (dummy-weight benchmarks) greedy steps still run as fused rounds, DSpark's and MTP's,
    which draw the rule on the device: the mean acceptance length of full-depth rounds is the one asked for (within
    5 sd), and each round commits its accepted drafts and then the target's choice (the runner's check)."""
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.runtime.runner import acceptance_probability
    torch.manual_seed(0)
    K, a = 3, 2.5
    llm = dspark.LLM(DEFAULT_MODEL / "mtp" if mode == "mtp" else DEFAULT_MODEL, speculative=mode, num_speculative_tokens=K,
                     max_num_seqs=4, max_model_len=160, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False,
                     simulate_acceptance=a)
    rounds, seen = emulate_rounds(llm), []
    read = rounds.read
    def spy(handle):                                          # each round's drafts verified and how many were taken
        rd = read(handle)
        seen.extend((len(t) - 1, acc) for t, acc in zip(rd.top, rd.accepted)); return rd
    rounds.read = spy
    prompts = [[5 + i, 9, 17 + 3 * i, 2] for i in range(4)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=90, ignore_eos=True), use_tqdm=False)
    assert rounds.replays > 20 and llm.runner.stats.simulated == a
    full = torch.tensor([acc for k, acc in seen if k == K], dtype=torch.double)
    p = acceptance_probability(a, K)
    pmf = torch.tensor([p ** j * (1 - p) for j in range(K)] + [p ** K], dtype=torch.double)
    m = (pmf * torch.arange(K + 1)).sum()
    sd = (pmf * (torch.arange(K + 1) - m) ** 2).sum().sqrt()
    assert len(full) > 80 and abs(full.mean() - m) <= 5 * sd / len(full) ** 0.5


def test_when_a_step_runs_as_a_round(tiny_ckpt):
    llm = dspark.LLM(tiny_ckpt, speculative="dspark", max_num_seqs=4, max_model_len=96, kv_cache_memory_bytes=16 * 2**20)
    r, pr = llm.runner, llm.runner.proposer
    g = GraphRunner(r.model, r.cache, r.forward, 4, r.cache.cc.lookahead, r.max_model_len, taps=pr.taps, capture=False,
                    context=pr.write_context)
    rounds = RoundGraphs(g, pr, capture=False)
    g.graphs = {n: None for n in g.sizes}                                     # pretend captured: only the rule is under test
    rounds.graphs = {R: None for R in rounds.sizes}
    w = rounds.width
    view = lambda start: SeqView([0, 1], [0, 1], 0, start)      # 64-token blocks: two cover max_model_len
    c = lambda n: torch.zeros(n, dtype=torch.long)
    assert rounds.fits([c(w)], [view(10)], [1])                               # anchor + γ drafts
    assert rounds.fits([c(w), c(w), c(3)], [view(10)] * 3, [1, 1, 1])         # ragged drafts: a 4-request round
    assert not rounds.fits([c(w)], [view(10)], [2])                           # two uncomputed committed tokens
    assert not rounds.fits([c(w + 1)], [view(10)], [1])                       # more rows than a round holds
    assert rounds.fits([c(2)] * 3, [view(10)] * 3, [1] * 3)                   # short of drafts (max_tokens): fixed K
    assert not rounds.fits([c(2)] * 3, [view(10)] * 3, [1] * 3, compact=True) # pruned: 4·(γ+1) rows > the 8-token graph
    assert not rounds.fits([c(w), c(w), c(3)], [view(10)] * 3, [1] * 3, compact=True)  # 15 tokens: the 16-token graph
    assert rounds.fits([c(w)] * 3 + [c(3)], [view(10)] * 4, [1] * 4, compact=True)     # 21 tokens: 24 either way
    with dspark.batch_invariant():
        assert not rounds.fits([c(w)], [view(10)], [1])


def random_rounds(trials: int, seed: int = 3):
    """Random rounds laid out by `fill_layout` in CPU step buffers: yields `(buf, fill, n, R, accepted, following)`,
    where `fill(starts, ids)` lays the same requests out again at `starts` (as the host would) and returns the rows.
    Buckets 1-8, widths 1-6, blocks of 4-16 (so new positions cross block boundaries), rows per request from 1 to the
    width, acceptance from none to all, resumed prefixes' `pooled_upto` on some."""
    from dspark.runtime.buffers import StepBuffers, fill_layout
    g = torch.Generator().manual_seed(seed)
    rnd = lambda hi, n: torch.randint(0, hi, (n,), generator=g).tolist()
    for trial in range(trials):
        width, bs, b = 1 + rnd(6, 1)[0], (4, 8, 16)[trial % 3], (1, 2, 4, 8)[trial % 4]
        R, n = 1 + rnd(b, 1)[0], b * width
        lens = [1 + m for m in rnd(width, R)]
        buf = StepBuffers.allocate(n, b, 127, bs, "cpu")
        starts, tables = rnd(100 - 2 * width, R), [rnd(50, -(-128 // bs)) for _ in range(R)]
        pooled = [rnd(s + 1, 1)[0] if trial % 5 == 0 else 0 for s in starts]
        slots = rnd(b, R)
        def fill(at, ids, tables=tables, slots=slots, pooled=pooled, lens=lens, buf=buf, n=n):
            seqs = [SeqView(t, t[::-1], sl, s, p) for t, sl, s, p in zip(tables, slots, at, pooled)]
            fill_layout(buf, lens, seqs, n, b, ids)
            return buf.packed[:n].clone()
        fill(starts, rnd(1000, sum(lens)))
        accepted = torch.tensor([rnd(m, 1)[0] for m in lens] + [0] * (b - R))
        yield buf, fill, n, starts, lens, accepted, torch.randint(0, 1000, (b, 6), generator=g)


def test_advance_layout_is_what_fill_layout_writes_at_the_new_positions():
    """The next round laid out on the device (chapter 23's `advance_layout`) against the host's `fill_layout` of the
    same requests at their new anchors, with the same row counts (`random_rounds`); padding rows stay padding."""
    from dspark.kernels.round import advance_layout
    crossed = 0
    for buf, fill, n, starts, lens, accepted, following in random_rounds(60):
        advance_layout(buf.packed, buf.window_tables, buf.block_size, accepted, following, n)
        got = buf.packed[:n].clone()
        new = [s + a + 1 for s, a in zip(starts, accepted.tolist())]
        crossed += sum((s + m - 1) // buf.block_size != (s2 + m - 1) // buf.block_size for s, s2, m in zip(starts, new, lens))
        want = fill(new, [t for i, m in enumerate(lens) for t in following[i, :m].tolist()])
        assert torch.equal(got, want)
    assert crossed > 10


@pytest.mark.parametrize("K", [1, 3])
def test_fused_mtp_rounds_match_the_eager_engine(reference_kernels, K):
    """MTP's rounds in one graph (the verify step, then the MTP layer over each request's accepted rows and its
    draft steps, on the device): the embedded model's trained MTP layer, whose drafts are accepted, so rounds end
    with none, some and all accepted; requests finish at different rounds, leaving padding requests in the bucket.
    Tokens, acceptance and the drafts verified at every step equal the eager engine's."""
    from dspark.tools.capacity_sweep import sweep_prompts
    from dspark.model.checkpoint import DEFAULT_MODEL
    prompts = [p[:n] for p, n in zip(sweep_prompts(DEFAULT_MODEL, 3, 40), (40, 23, 31))]
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (22, 9, 17)]
    outs, stats, drafts = [], [], []
    for fused in (False, True):
        llm = dspark.LLM(DEFAULT_MODEL / "mtp", speculative="mtp", num_speculative_tokens=K, max_num_seqs=3,
                         max_model_len=128, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
        if fused: rounds = emulate_rounds(llm)
        seen, schedule = [], llm.scheduler.schedule
        def spy(schedule=schedule, seen=seen):
            batch = schedule()
            seen.append({r.request_id: list(r.drafts) for r, _ in batch}); return batch
        llm.scheduler.schedule = spy
        o = llm.generate(prompts, sp, use_tqdm=False)
        outs.append([x.outputs[0].token_ids for x in o]); stats.append(llm.runner.stats); drafts.append(seen)
    assert rounds.replays > 5 and rounds.K == K
    assert outs[0] == outs[1] and [len(t) for t in outs[1]] == [22, 9, 17]
    s = stats[1]
    assert stats[0] == s and 0 < s.num_accepted_tokens < s.num_draft_tokens and s.accepted_per_position[-1] > 0
    assert drafts[0] == drafts[1]
