"""Speculative decoding end to end: lossless (greedy identity, sampled distribution), bookkeeping (oracle
drafter, scripted accept patterns), state after rejected drafts, and the prefix cache."""
import math

import pytest
import torch

import dspark
from dspark.entrypoints.llm import LLM
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, forward_cached
from dspark.sample.sampling import SamplingParams

KV = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)


@pytest.fixture(scope="module")
def ck7(tmp_path_factory):
    "A tiny checkpoint whose DSpark drafter has block size 7, so K = 1..7 can be verified."
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("dsp7"), seed=3, drafter="dspark", dspark_block_size=7)


def _prompts(n, seed, lo=4, hi=80):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def ckm(tmp_path_factory):
    "A tiny checkpoint with an MTP layer (mtp.0 with e_proj/h_proj) instead of DSpark stages."
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("mtp"), seed=3, drafter="mtp")


@pytest.fixture(scope="module")
def greedy_ref(ck7):
    prompts = _prompts(4, seed=1)
    base = LLM(ck7, **KV)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return prompts, sp, _ids(base.generate(prompts, sp, use_tqdm=False))


@pytest.mark.parametrize("K", range(1, 8))
def test_greedy_identity(ck7, greedy_ref, K):
    prompts, sp, ref = greedy_ref
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=K, **KV)
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == ref
    st = spec.spec_stats()
    assert st["num_drafts"] > 0 and st["num_draft_tokens"] <= K * st["num_drafts"]


@pytest.mark.parametrize("K", range(1, 8))
def test_greedy_identity_mtp(ckm, K):
    prompts = _prompts(4, seed=21)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _ids(LLM(ckm, **KV).generate(prompts, sp, use_tqdm=False))
    spec = LLM(ckm, speculative="mtp", num_speculative_tokens=K, **KV)
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == ref and spec.spec_stats()["num_drafts"] > 0



def test_one_page_round_matches_the_engine(ck7, greedy_ref):
    "Repeating the plain-torch `dspark_round` with the real drafter emits the engine's greedy tokens (chapter 19's page)."
    from dspark.model.drafter import load_drafter
    from dspark.spec.proposers import dspark_proposer, dspark_round
    prompts, sp, ref = greedy_ref
    target = dspark.load_target(ck7); drafter = load_drafter(ck7, target)
    propose, n = dspark_proposer(target, drafter, sp), sp.max_tokens
    for prompt, want in list(zip(prompts, ref))[:2]:
        seq = torch.tensor(prompt)
        with torch.no_grad():
            while len(seq) < len(prompt) + n:
                seq = torch.cat([seq, dspark_round(lambda s: target.logits(s[None])[0], propose, seq, sp)])
        assert seq[len(prompt):len(prompt) + n].tolist() == want


def _toy_chains(V=4, K=3, seed=0):
    "A Markov-chain target and a different Markov-chain drafter on a vocabulary of `V`, drafting `K` tokens."
    g = torch.Generator().manual_seed(seed)
    T_p, T_q = torch.randn(V, V, generator=g) * 1.5, torch.randn(V, V, generator=g) * 1.5
    gq = torch.Generator().manual_seed(seed + 1)

    def propose(tokens):
        drafts, q, last = [], [], int(tokens[-1])
        for _ in range(K):
            qk = T_q[last].softmax(-1); last = int(torch.multinomial(qk, 1, generator=gq))
            drafts.append(last); q.append(qk)
        return torch.tensor(drafts), torch.stack(q)
    return T_p, (lambda seq: T_p[seq]), propose


def test_one_page_round_is_lossless():
    "The first two tokens the round emits follow the target's joint law (chi-square), and greedy rounds emit its argmax."
    from dspark.spec.proposers import dspark_round
    T_p, logits_fn, propose = _toy_chains()
    V, n, g = T_p.shape[0], 5000, torch.Generator().manual_seed(2)
    counts = torch.zeros(V, V)
    for _ in range(n):
        seq = torch.tensor([0])
        while len(seq) < 3: seq = torch.cat([seq, dspark_round(logits_fn, propose, seq, SamplingParams(temperature=1.0), g)])
        counts[seq[1], seq[2]] += 1
    P1 = T_p.softmax(-1)
    expected = n * P1[0][:, None] * P1
    assert float(((counts - expected) ** 2 / expected).sum()) < 37.7      # 15 degrees of freedom, p = 0.001
    seq, greedy = torch.tensor([0]), SamplingParams(temperature=0.0)
    while len(seq) < 20: seq = torch.cat([seq, dspark_round(logits_fn, propose, seq, greedy)])
    want = [0]
    for _ in range(len(seq) - 1): want.append(int(T_p[want[-1]].argmax()))
    assert seq.tolist() == want

class Oracle:
    "A proposer whose drafts are the target's own greedy continuation (one-hot q)."
    def __init__(self, seqs, V):
        self.seqs, self.V = seqs, V
    def __call__(self, slot, rid, anchor, P, n, params, seed):
        seq = next(s for s in self.seqs if len(s) > P and s[P] == anchor)
        toks = (seq[P + 1:P + 1 + n] + [0] * n)[:n]
        return toks, torch.nn.functional.one_hot(torch.tensor(toks), self.V).float()


def _patch_oracle(llm, full_seqs):
    llm.runner.proposer.propose = Oracle(full_seqs, llm.model.cfg.vocab_size)
    llm.runner.proposer.propose_greedy = llm.runner.proposer.propose_sampled = None   # no batched drafter: every
    # round asks the oracle


@pytest.mark.parametrize("method,K", [("dspark", 1), ("dspark", 3), ("dspark", 7), ("mtp", 2), ("mtp", 5)])
def test_oracle_drafter_accepts_everything(ck7, ckm, method, K):
    "With drafts equal to the target's greedy continuation every draft is accepted: τ = K + 1 (up to truncation)."
    ck = ck7 if method == "dspark" else ckm
    prompt = _prompts(1, seed=9, lo=20, hi=21)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _ids(LLM(ck, **KV).generate([prompt], sp, use_tqdm=False))[0]
    spec = LLM(ck, speculative=method, num_speculative_tokens=K, **KV)
    _patch_oracle(spec, [prompt + ref])
    assert _ids(spec.generate([prompt], sp, use_tqdm=False))[0] == ref
    st = spec.spec_stats()
    assert st["num_accepted_tokens"] == st["num_draft_tokens"] and st["draft_acceptance_rate"] == 1.0
    full_rounds = (40 - 1) // (K + 1)                    # 1 token from prefill, then K+1 per round
    assert st["accepted_per_position"][K - 1] >= full_rounds
    assert st["mean_acceptance_length"] >= K + 1 - K / st["num_drafts"]


def test_scripted_accept_pattern(ck7):
    """Forced drafts whose first 5, 0 and 2 tokens are right give the hand-computed counters. With
    max_tokens = 11 the engine drafts only what can still be emitted: 5 drafts after the first token,
    3 after the 7th (11 − 7 − 1), 2 after the 8th."""
    prompt = _prompts(1, seed=10, lo=12, hi=13)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=1 + 6 + 1 + 3, ignore_eos=True)
    ref = _ids(LLM(ck7, **KV).generate([prompt], sp, use_tqdm=False))[0]
    seq = prompt + ref
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=5, **KV)
    script = iter([5, 0, 2])
    V = spec.model.cfg.vocab_size

    def propose(slot, rid, anchor, P, n, params, seed):
        good = next(script)
        toks = (seq[P + 1:P + 1 + good] + [(seq[P + 1 + good] + 1) % V] * 7)[:n]
        return toks, torch.nn.functional.one_hot(torch.tensor(toks), V).float()

    spec.runner.proposer.propose = propose
    spec.runner.proposer.propose_greedy = spec.runner.proposer.propose_sampled = None   # every round: the script
    assert _ids(spec.generate([prompt], sp, use_tqdm=False))[0] == ref
    st = spec.spec_stats()
    assert (st["num_drafts"], st["num_draft_tokens"], st["num_accepted_tokens"]) == (3, 5 + 3 + 2, 5 + 0 + 2)
    assert st["accepted_per_position"] == [2, 2, 1, 1, 1]
    assert math.isclose(st["mean_acceptance_length"], 1 + 7 / 3)


def test_stop_token_accepted_inside_the_draft_truncates(ck7):
    prompt = _prompts(1, seed=11, lo=15, hi=16)[0]
    free = _ids(LLM(ck7, **KV).generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False))[0]
    stop = free[9]
    sp = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop], ignore_eos=True)
    ref = _ids(LLM(ck7, **KV).generate([prompt], sp, use_tqdm=False))[0]
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=7, **KV)
    _patch_oracle(spec, [prompt + free])
    out = spec.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref and out.token_ids[-1] == stop and out.finish_reason == "stop"


def test_max_tokens_truncation(ck7, greedy_ref):
    prompts, _, _ = greedy_ref
    for n in (1, 2, 9):
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        spec = LLM(ck7, speculative="dspark", num_speculative_tokens=7, **KV)
        _patch_oracle(spec, [p + r for p, r in zip(prompts, _ids(LLM(ck7, **KV).generate(prompts, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)))])
        outs = spec.generate(prompts, sp, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == n and o.outputs[0].finish_reason == "length" for o in outs)


def test_sampled_distribution_matches_target(tmp_path):
    """T = 1 on a 16-token vocabulary: the first two generated tokens follow the target's exact distribution
    (enumerated from the target's logits), with speculative decoding on."""
    ck = dspark.make_tiny_checkpoint(tmp_path / "v16", seed=5, drafter="dspark", vocab_size=16, dspark_block_size=3)
    target = dspark.load_target(ck)
    prompt = [0, 5, 9, 3]
    p1 = target.logits(torch.tensor([prompt]))[0, -1].softmax(-1).double()
    p2 = torch.stack([target.logits(torch.tensor([prompt + [x]]))[0, -1].softmax(-1) for x in range(16)]).double()
    m2 = p1 @ p2
    spec = LLM(ck, speculative="dspark", num_speculative_tokens=3, max_num_seqs=64, max_num_batched_tokens=1024,
               kv_cache_memory_bytes=64 * 2**20)
    N = 1200
    # max_tokens 4: after the first token, one verify round with 2 drafts decides the second token
    outs = spec.generate([prompt] * N, [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True) for s in range(N)], use_tqdm=False)
    x = torch.tensor([o.outputs[0].token_ids[:2] for o in outs])
    assert spec.spec_stats()["num_accepted_tokens"] > 50              # the drafter's tokens are really being used
    for col, exact in ((0, p1), (1, m2)):
        counts = torch.bincount(x[:, col], minlength=16).double()
        keep = exact * N >= 5
        obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
        exp = torch.cat([exact[keep], exact[~keep].sum(0, keepdim=True)]) * N
        chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
        dof = int(keep.sum())
        p_value = float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)))
        assert p_value > 1e-3, (col, chi2, dof)


def _partly_rejected_caches(model):
    """Caches after [anchor, drafts] rounds of which 2 drafts are accepted (positions 60..62 committed), then the
    run continuing from the committed length to position 89: with rejected drafts [7, 8, 9], with [400, 3, 77],
    and with none (only the committed tokens ever processed)."""
    ids = torch.randint(0, 512, (90,), generator=torch.Generator().manual_seed(2))
    def run(rejected):
        cc = CacheConfig(block_size=32, num_blocks=8, num_window_blocks=8, max_seqs=1, lookahead=5)
        cache = PagedKVCache(model.cfg, cc)
        view = lambda s: SeqView([0, 1, 2, 3], [0, 1, 2, 3], 0, s)
        forward_cached(model, cache, [ids[:60]], [view(0)])
        forward_cached(model, cache, [torch.cat([ids[60:63], torch.tensor(rejected, dtype=torch.long)])], [view(60)])
        forward_cached(model, cache, [ids[63:90]], [view(63)])
        return cache
    return run([7, 8, 9]), run([400, 3, 77]), run([])


def _committed(cache, model):
    "Every committed cache row of positions 0..89: window rows, then compressed entries and indexer keys per layer."
    rows = {("window", l): w[:3].flatten(0, 1)[:90] for l, w in enumerate(cache.window)}
    for pools in ("entries", "index_keys"):
        for l, pool in getattr(cache, pools).items():
            rows[pools, l] = pool[:3].flatten(0, 1)[:90 // model.cfg.ratio(l)]
    return rows


def test_cache_after_partly_rejected_round_equals_committed_only(tiny_model):
    """In batch-invariant mode the cache of every committed position (window rows, compressed entries, indexer
    keys; positions 0..89, all layers) is bitwise the cache of a run that processed only the committed tokens:
    no trace of the rejected drafts is left, not even in the last bit."""
    with dspark.batch_invariant():
        a, b, c = (_committed(x, tiny_model) for x in _partly_rejected_caches(tiny_model))
    assert len(c) == tiny_model.cfg.num_hidden_layers + 2 * 2 + 2     # 6 window layers, 4 CSA/HCA, 2 indexers
    for key, want in c.items():
        assert torch.equal(a[key], want) and torch.equal(b[key], want), key


def test_cache_after_partly_rejected_round_default_mode(tiny_model):
    """The same in the default (fast) reference mode: bitwise for everything written before the round, within
    1e-5 for what the round and later steps wrote. Not bitwise there: CPU fp32 GEMMs round a row differently
    depending on how many rows share the call (measured up to 2e-5 for fewer than 8 rows), SIMD and scalar
    code paths of `sigmoid`/`silu`/`softplus` differ in the last bit, and the rejected drafts change the row
    counts of the verify call and of the MoE's expert groups. A leaked state would show up as an O(1) difference."""
    a, b, c = (_committed(x, tiny_model) for x in _partly_rejected_caches(tiny_model))
    for (pool, l), want in c.items():
        if pool == "window":
            assert torch.equal(a[pool, l][:60], want[:60]) and torch.equal(b[pool, l][:60], want[:60])
        torch.testing.assert_close(a[pool, l], want, rtol=0, atol=1e-5)
        torch.testing.assert_close(b[pool, l], want, rtol=0, atol=1e-5)


def test_prefix_cache_same_tokens_and_acceptance(ck7):
    shared = _prompts(1, seed=12, lo=150, hi=151)[0]
    prompts = [shared + p for p in _prompts(2, seed=13, lo=3, hi=9)]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    cold = LLM(ck7, speculative="dspark", num_speculative_tokens=4, enable_prefix_caching=False, **KV)
    ref, ref_stats = [], []
    for p in prompts:
        before = cold.spec_stats()["num_accepted_tokens"]
        ref.append(_ids(cold.generate([p], sp, use_tqdm=False))[0]); ref_stats.append(cold.spec_stats()["num_accepted_tokens"] - before)
    warm = LLM(ck7, speculative="dspark", num_speculative_tokens=4, **KV)
    warm.generate([prompts[0]], sp, use_tqdm=False)                    # fills the prefix cache
    for p, r, acc in zip(prompts, ref, ref_stats):
        before, hits = warm.spec_stats()["num_accepted_tokens"], warm.prefix_cache_stats()["hits"]
        out = warm.generate([p], sp, use_tqdm=False)[0]
        assert warm.prefix_cache_stats()["hits"] > hits and out.num_cached_tokens > 0
        assert out.outputs[0].token_ids == r
        assert warm.spec_stats()["num_accepted_tokens"] - before == acc


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(speculative="mtp"), ValueError, "MTP"),
    (dict(speculative="dspark", num_speculative_tokens=0), ValueError, "num_speculative_tokens"),
    (dict(speculative="dspark", num_speculative_tokens=8), ValueError, "num_speculative_tokens"),
    (dict(num_speculative_tokens=3), ValueError, "speculative"),
])
def test_bad_speculative_settings(ck7, kwargs, err, match):
    with pytest.raises(err, match=match):
        LLM(ck7, **kwargs)


def test_dspark_without_drafter_weights(tmp_path, ckm):
    ck = dspark.make_tiny_checkpoint(tmp_path / "nodraft", drafter=None)
    with pytest.raises(ValueError, match="DSpark"):
        LLM(ck, speculative="dspark")
    with pytest.raises(ValueError, match="DSpark"):
        LLM(ckm, speculative="dspark")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(ckm, speculative="mtp", num_speculative_tokens=9)


def test_eos_accepted_inside_the_draft_ends_the_request(ck7):
    "An EOS accepted inside a draft ends the round and the request there (the tokenizer's EOS id is moved onto a token the model emits)."
    prompt = _prompts(1, seed=14, lo=15, hi=16)[0]
    free = _ids(LLM(ck7, **KV).generate([prompt], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False))[0]
    eos = free[7]
    base = LLM(ck7, **KV); base.tokenizer.eos_token_id = eos
    ref = _ids(base.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False))[0]
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=7, **KV); spec.tokenizer.eos_token_id = eos
    _patch_oracle(spec, [prompt + free])
    out = spec.generate([prompt], SamplingParams(temperature=0.0, max_tokens=30), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref == free[: free.index(eos) + 1] and out.finish_reason == "stop"
    assert spec.spec_stats()["num_accepted_tokens"] > 0


def test_prefix_hit_shorter_than_the_drafter_window_is_not_used(ck7):
    """With a drafter, a prefix-cache hit resumes `sliding_window` positions before its end (the draft context
    needs target features there). A hit shorter than that (here 32 cached tokens, window 64, 16-token blocks)
    must not be used — resuming before position 0 broke the step — and the repeat gives the cold run's tokens."""
    prompt = _prompts(1, seed=21, lo=40, hi=41)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(ck7, speculative="dspark", num_speculative_tokens=3, block_size=16, **KV)
    cold = _ids(llm.generate([prompt], sp, use_tqdm=False))
    assert _ids(llm.generate([prompt], sp, use_tqdm=False)) == cold


@pytest.mark.parametrize("sampled", [False, True])
def test_batched_mtp_equals_per_request_mtp(ckm, sampled):
    """The batched MTP proposer (one `step_many` forward per step for every verified request, batched draft
    steps) gives the same tokens, drafts and acceptance as drafting request by request: the same window rows
    are visible to each token, and each draft is drawn from the same keyed stream."""
    prompts = _prompts(4, seed=23)
    sps = [SamplingParams(temperature=0.9 if sampled else 0.0, top_k=[-1, 5, -1, 20][i], top_p=[1.0, 1.0, 0.8, 1.0][i],
                          max_tokens=20, ignore_eos=True, seed=100 + i) for i in range(4)]
    runs = []
    for batched in (True, False):
        llm = LLM(ckm, speculative="mtp", num_speculative_tokens=3, **KV)
        if not batched: llm.runner.proposer.propose_greedy = llm.runner.proposer.propose_sampled = None
        calls = []
        if batched:
            real = llm.runner.proposer.observe_many
            llm.runner.proposer.observe_many = lambda *a: (calls.append(len(a[0])), real(*a))[1]
        runs.append((_ids(llm.generate(prompts, sps, use_tqdm=False)), llm.spec_stats()))
        if batched: assert max(calls) == 4                       # the four requests drafted in one batch
    assert runs[0] == runs[1]
    assert runs[0][1]["num_drafts"] > 0


def test_mtp_step_many_equals_step_per_request(ckm):
    """`MTPDrafter.step_many` against `step` request by request, on rings with a history: the same logits and
    output streams, and the same window rows left in the ring. The requests' positions overlap, so a token that
    saw another request's rows, or a stale draft row at or past its chunk, would change its output."""
    import copy
    llm = LLM(ckm, speculative="mtp", num_speculative_tokens=3, **KV)
    mtp, cfg = llm.runner.proposer.mtp, llm.model.cfg
    ring = llm.runner.proposer.ring
    g = torch.Generator().manual_seed(0)
    D, hc, n = cfg.hidden_size, cfg.hc_mult, ring.rows.shape[1]
    for s in range(3):                                     # histories: slot s holds positions up to 40 + 5s + 2
        ring.claim(s, f"r{s}")                             # (the last rows past each chunk's start: stale drafts)
        pos = torch.arange(0, 43 + 5 * s)
        ring.write(s, torch.randn(len(pos), cfg.head_dim, generator=g)[-n:], pos[-n:])
    before = copy.deepcopy(ring)
    slots, counts, firsts = [0, 1, 2], [1, 3, 2], [41, 45, 50]
    T = sum(counts)
    h = torch.randn(T, hc, D, generator=g)
    ids = torch.randint(2, cfg.vocab_size, (T,), generator=g)
    positions = torch.cat([torch.arange(a, a + c) for a, c in zip(firsts, counts)])
    many = mtp.step_many(h, ids, positions, ring, slots, counts, firsts)
    one, a = [], 0
    for s, c in zip(slots, counts):
        one.append(mtp.step(h[a:a + c], ids[a:a + c], positions[a:a + c], before, s)); a += c
    torch.testing.assert_close(many[0], torch.cat([o[0] for o in one]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(many[1], torch.cat([o[1] for o in one]), rtol=1e-5, atol=1e-5)
    assert torch.equal(ring.pos, before.pos) and torch.allclose(ring.rows, before.rows, atol=1e-6)


def test_mtp_layer_runs_its_swappable_mhc(ckm):
    "The MTP layer's hyper-connections go through `mhc`, which the GPU fast path swaps for the fused kernels."
    llm = LLM(ckm, speculative="mtp", num_speculative_tokens=2, **KV)
    mtp = llm.runner.proposer.mtp
    calls = []
    wrap = lambda name, f: (lambda *a, **k: (calls.append(name), f(*a, **k))[1])
    ref = _ids(llm.generate(_prompts(2, seed=31), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False))
    mtp.mhc = tuple(wrap(n, f) for n, f in zip(("pre", "post", "head"), mtp.mhc))
    out = _ids(llm.generate(_prompts(2, seed=31), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False))
    assert out == ref and {"pre", "post", "head"} <= set(calls)
