"""The DSpark context ring written inside the captured step (`DSparkProposer.write_context`), checked on CPU by
standing in for the graphs: each bucket's "replay" reruns `forward_static` on the runner's persistent buffers,
which is exactly the work a captured graph records. The engine then skips `observe`; its drafts, acceptance and
tokens must equal the eager engine's, which observes committed positions only."""
import pytest
import torch

import dspark
from dspark.graphs import GraphRunner, forward_static
from dspark.sampling import SamplingParams


class EagerReplay:
    "A captured graph's stand-in: `replay()` reruns the step and copies into the outputs of the first run."
    def __init__(self, run, out):
        self.run, self.out = run, out

    def replay(self) -> None:
        new = self.run()
        for name in ("logits", "features", "finals"):
            if getattr(self.out, name) is not None: getattr(self.out, name).copy_(getattr(new, name))


def emulate_graphs(llm, max_num_seqs: int) -> GraphRunner:
    r, pr = llm.runner, llm.runner.proposer
    g = GraphRunner(r.model, r.cache, r.forward, max_num_seqs, r.cache.cc.lookahead, r.max_model_len, taps=pr.taps,
                    capture=False, context=pr.write_context)
    for n in g.sizes:
        run = lambda n=n: forward_static(g.model, g.cache, g.buf, n, g.taps, g.finals, g.mhc, g.context)
        g._pad_only(n)
        g.graphs[n] = (EagerReplay(run, run()), None)
        g.graphs[n] = (g.graphs[n][0], g.graphs[n][0].out)
    r.forward = llm.graphs = g
    return g


@pytest.mark.parametrize("max_tokens", [24])
def test_in_graph_context_ring_matches_observe(tiny_ckpt, max_tokens, monkeypatch):
    import dspark.graphs as G
    from dspark.kernels_attention import indexer_topk_ref, sparse_attention_ref
    from dspark.kernels_fused import qkv_rope_insert_ref
    def rope_insert_(q, *a, **k):                                       # the kernel's contract: Q rewritten in place
        out = qkv_rope_insert_ref(q, *a, **k); q.copy_(out[0]); return out
    monkeypatch.setattr(G, "sparse_attention", sparse_attention_ref)    # the kernels' torch references: the ring
    monkeypatch.setattr(G, "indexer_topk", indexer_topk_ref)            # plumbing is under test, not Triton
    monkeypatch.setattr(G, "qkv_rope_insert_", rope_insert_)
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
