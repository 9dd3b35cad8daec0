"""Chapter 24: MTP drafting in fixed shapes (the CUDA-graph layout), run uncaptured on the CPU against the eager
MTP proposer of chapter 10."""
import copy

import pytest
import torch

import dspark
from dspark import LLM, SamplingParams
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.runtime.runner import next_ids
from dspark.model.mtp import MTPRing, load_mtp
from dspark.runtime.mtp_graphs import MTPGraphs
from dspark.kernels.fused import qkv_rope_insert_
from dspark.kernels.mtp import mtp_ring_attention
from dspark.request import Request

KV = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def mtp(tmp_path_factory):
    ck = dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), seed=3, drafter="mtp")
    return load_mtp(ck, dspark.load_target(ck, device="cpu", dtype="float32"))


@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
@pytest.mark.parametrize("seed", range(5))
def test_step_rows_with_padding_equals_step_per_request(mtp, seed, kernels):
    """Random requests (chunk lengths 1..4, stale draft rows in their rings), padding rows and padding requests,
    a key width past the longest chunk: the real rows' logits and streams, and every request's ring, equal those
    of `step` run request by request (the reference); padding writes only the scratch slot, which stays invisible.
    `kernels`: `step_rows` on the GPU fast path's kernels (chapter 17c's ring attention, which then writes the ring
    too, and the fused q/kv rotation, here on Triton's interpreter), against the same torch reference."""
    cfg, g = mtp.cfg, torch.Generator().manual_seed(seed)
    ring = MTPRing(cfg, 5, 3, torch.float32, "cpu")
    n = ring.rows.shape[1]
    R = int(torch.randint(1, 5, (1,), generator=g))
    slots = torch.randperm(5, generator=g)[:R].tolist()
    counts = torch.randint(1, 5, (R,), generator=g).tolist()
    firsts = torch.randint(0, 3 * n, (R,), generator=g).tolist()
    for s, a in zip(slots, firsts):                      # history up to a, plus stale drafts at and after it
        top = a + int(torch.randint(0, 4, (1,), generator=g))
        ring.claim(s, str(s))
        ring.rows[s] = torch.randn(ring.rows.shape[1:], generator=g)
        p = torch.arange(top - n, top)
        ring.pos[s, p.clamp(min=0) % n] = torch.where(p >= 0, p, -1)
    T = sum(counts)
    h = torch.randn(T, cfg.hc_mult, cfg.hidden_size, generator=g)
    nxt = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    pos = torch.cat([torch.arange(a, a + m) for a, m in zip(firsts, counts)])
    want_ring, want, a = copy.deepcopy(ring), [], 0
    for s, m in zip(slots, counts):
        want.append(mtp.step(h[a:a + m], nxt[a:a + m], pos[a:a + m], want_ring, s)); a += m
    pad_rows, pad_reqs = int(torch.randint(0, 4, (1,), generator=g)), int(torch.randint(0, 3, (1,), generator=g))
    z = torch.zeros(pad_rows, dtype=torch.long)
    if kernels: mtp.rope_kernel, mtp.ring_kernel = qkv_rope_insert_, mtp_ring_attention
    try: got, got_x = mtp.step_rows(
        torch.cat([h, torch.randn(pad_rows, *h.shape[1:], generator=g)]), torch.cat([nxt, z]), torch.cat([pos, z]),
        torch.tensor([i for i, m in enumerate(counts) for _ in range(m)] + [-1] * pad_rows), ring,
        torch.tensor(slots + [ring.scratch] * pad_reqs), torch.tensor(firsts + [0] * pad_reqs),
        torch.tensor([a + m - 1 for a, m in zip(firsts, counts)] + [0] * pad_reqs),
        torch.tensor([sum(counts[:i]) for i in range(R)] + [0] * pad_reqs), 4 if kernels else 5)
    # torch: a width past the longest chunk; kernels: the widest whose ring writes the attention launch makes itself
    finally: mtp.rope_kernel = mtp.ring_kernel = None
    torch.testing.assert_close(got[:T], torch.cat([w[0] for w in want]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_x[:T], torch.cat([w[1] for w in want]), rtol=1e-5, atol=1e-5)
    for s in range(5):
        torch.testing.assert_close(ring.pos[s], want_ring.pos[s])
        torch.testing.assert_close(ring.rows[s], want_ring.rows[s])
    assert (ring.pos[ring.scratch] == -1).all()


def test_next_ids_slices_the_committed_sequence():
    r = Request("r", [1, 2, 3, 4], SamplingParams(), 0, output_ids=[5, 6], drafts=[90, 91, 92])
    for toks in ([7], [7, 8, 9]):
        seq = r.all_ids + toks
        for a in range(len(seq)):
            for m in range(1, len(seq) - a):
                assert next_ids(r, toks, a, m) == seq[a + 1:a + m + 1], (toks, a, m)


def _run(llm, prompts, params, graphed: bool):
    "Step by step: each request's drafts after every step, and the final tokens."
    if graphed: llm.runner.proposer.graphs = MTPGraphs(llm.runner.proposer, KV["max_num_seqs"], capture=False)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    reqs, seen = {}, []
    while llm.has_unfinished_requests():
        llm.step()
        reqs |= {r.request_id: r for r in llm.scheduler.running}
        seen.append({rid: list(r.drafts) for rid, r in reqs.items() if r.finish_reason is None})
    return [llm.pop_output(i).outputs[0].token_ids for i in ids], seen, llm.spec_stats()


@pytest.mark.parametrize("K", [1, 3])
def test_uncaptured_graphs_draft_as_the_eager_proposer(K):
    """The embedded trained model's MTP layer (its drafts are accepted, so steps commit 1..K+1 positions): with the
    graphs' layout the engine proposes the same drafts at every step and produces the same tokens and acceptance.
    Requests of different lengths finish at different steps, leaving padding in the bucket."""
    prompts = sweep_prompts(DEFAULT_MODEL, 3, 24)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 11, 16)]
    make = lambda: LLM(DEFAULT_MODEL / "mtp", speculative="mtp", num_speculative_tokens=K, **KV)
    want = _run(make(), prompts, params, graphed=False)
    llm = make()
    got = _run(llm, prompts, params, graphed=True)
    assert got == want
    assert llm.runner.proposer.graphs.replays > 5
    assert want[2]["mean_acceptance_length"] > 1.2          # steps with accepted drafts were exercised


def test_sampled_requests_keep_the_eager_path():
    """A step with a sampled request drafts eagerly (its drafts need their distributions); greedy-only steps
    replay. Every request's tokens equal those without graphs."""
    prompts = sweep_prompts(DEFAULT_MODEL, 2, 16)
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=14, seed=3, ignore_eos=True)]
    make = lambda: LLM(DEFAULT_MODEL / "mtp", speculative="mtp", num_speculative_tokens=2, **KV)
    want = _run(make(), prompts, params, graphed=False)
    llm = make()
    graphed = llm.runner.proposer.graphs = MTPGraphs(llm.runner.proposer, KV["max_num_seqs"], capture=False)
    calls = []
    eager = llm.runner.proposer.propose_sampled
    llm.runner.proposer.propose_sampled = lambda *a: calls.append(len(a[0])) or eager(*a)
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    while llm.has_unfinished_requests(): llm.step()
    assert [llm.pop_output(i).outputs[0].token_ids for i in ids] == want[0]
    assert calls and graphed.replays == 0                  # the sampled request outlives the greedy one
    llm2 = make()
    alone = _run(llm2, prompts[:1], params[:1], graphed=True)
    assert alone[0] == [want[0][0]] and llm2.runner.proposer.graphs.replays > 0


def test_step_chunks_runs_a_long_chunks_newest_window_only(mtp):
    """A prefill-sized chunk (three windows long) beside short ones: `step_chunks` runs only each chunk's newest
    window, in groups kept under a key-gather budget, and each request's last logits and stream equal `step` over
    the whole chunk; the ring rows a later row can see (the newest window) are the same too."""
    cfg, g = mtp.cfg, torch.Generator().manual_seed(7)
    w = cfg.sliding_window
    counts, firsts, slots = [3 * w + 5, 2, w, 1], [0, 40, 7, 3 * w], [0, 1, 2, 3]
    h = [torch.randn(m, cfg.hc_mult, cfg.hidden_size, generator=g) for m in counts]
    nxt = [torch.randint(0, cfg.vocab_size, (m,), generator=g) for m in counts]
    want_ring, want = MTPRing(cfg, 4, 2, torch.float32, "cpu"), []
    for s, x, t, a in zip(slots, h, nxt, firsts):
        want_ring.claim(s, str(s))
        lg, out = mtp.step(x, t, torch.arange(a, a + x.shape[0]), want_ring, s)
        want.append((lg[-1], out[-1]))
    for budget in (2**40, 1):                                  # one group; then every request alone
        ring = MTPRing(cfg, 4, 2, torch.float32, "cpu")
        for s in slots: ring.claim(s, str(s))
        lg, out = mtp.step_chunks(h, nxt, [torch.arange(a, a + m) for a, m in zip(firsts, counts)], ring, slots, firsts,
                                  budget=budget)
        for i, (wl, wo) in enumerate(want):
            torch.testing.assert_close(lg[i], wl, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[i], wo, rtol=1e-5, atol=1e-5)
        for s, a, m in zip(slots, firsts, counts):             # the newest window of each request, slot by slot
            last = a + m - 1
            seen = (ring.pos[s] > last - w) & (ring.pos[s] >= 0)
            assert seen.sum() == min(m, w)
            torch.testing.assert_close(ring.rows[s][seen], want_ring.rows[s][seen], rtol=1e-5, atol=1e-5)
            assert torch.equal(ring.pos[s][seen], want_ring.pos[s][seen])
