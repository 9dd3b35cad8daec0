"""vLLM's logit processors (chapter 02a): the reference against hand-computed cases, validation, greedy identity
with speculation on and off, and the speculative sampler's output distribution against the processed target's
(enumerated from the target's logits) — the rejection-sampling oracle of reference dspark.md on processed rows."""
import math

import pytest
import torch

import dspark
from dspark.entrypoints.llm import LLM
from dspark.sample.processors import apply_processors, processed_probs, round_histories
from dspark.sample.sampling import SamplingParams

T = lambda *v: torch.tensor([list(v)], dtype=torch.float32)


def test_logit_bias_adds_to_chosen_ids():
    sp = SamplingParams(logit_bias={1: 2.0, "2": -1})                   # numeric string keys are token ids
    assert sp.logit_bias == {1: 2.0, 2: -1.0}
    assert torch.equal(apply_processors(T(0, 0, 0, 0), sp, [([9], [])]), T(0, 2, -1, 0))


def test_min_tokens_masks_stop_ids_until_reached():
    sp = SamplingParams(min_tokens=2, stop_token_ids=[2])
    x = torch.zeros(3, 4)
    out = apply_processors(x, sp, [([0], []), ([0], [1]), ([0], [1, 1])], stop_ids={3})   # 3: the eos
    inf = float("-inf")
    assert torch.equal(out, torch.tensor([[0, 0, inf, inf], [0, 0, inf, inf], [0, 0, 0, 0.]]))


def test_repetition_penalty_over_prompt_and_output():
    sp = SamplingParams(repetition_penalty=2.0)
    out = apply_processors(T(2, -2, 1, 3), sp, [([0], [1])])            # 0 in the prompt, 1 generated
    assert torch.equal(out, T(1, -4, 1, 3))


def test_frequency_and_presence_count_generated_tokens_only():
    sp = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_processors(T(0, 0, 0, 0), sp, [([3, 3], [1, 1, 2])])   # the prompt's 3 is not counted
    assert torch.equal(out, T(0, -1.25, -0.75, 0))


def test_order_bias_before_penalties():
    "vLLM's order: the bias first, then the repetition penalty divides the biased logit (1 + 1) / 2, not 1/2 + 1."
    sp = SamplingParams(logit_bias={0: 1.0}, repetition_penalty=2.0)
    assert torch.equal(apply_processors(T(1, 0), sp, [([], [0])]), T(1, 0))


def test_min_p_drops_tokens_below_the_scaled_max():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    sp = SamplingParams(min_p=0.2)                                     # threshold 0.2 * 0.5 = 0.1
    out = processed_probs(p.log()[None], sp, [([], [])])
    torch.testing.assert_close(out, (torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95)[None])


def test_greedy_is_the_processed_argmax_and_histories_grow_with_drafts():
    sp = SamplingParams(temperature=0, presence_penalty=2.0)
    hist = round_histories([5], [0], [1, 2], 3)
    assert hist == [([5], [0]), ([5], [0, 1]), ([5], [0, 1, 2])]
    out = processed_probs(T(3, 2.5, 2, 0).repeat(3, 1), sp, hist)      # 0 then 1 then 2 penalised by 2
    assert out.argmax(-1).tolist() == [1, 2, 0]                       # rows: [1, 2.5, 2, 0], [1, .5, 2, 0], [1, .5, 0, 0]


def test_plain_requests_are_not_processed():
    assert not SamplingParams().processed and not SamplingParams(temperature=0, top_k=3, top_p=0.5).processed
    for kw in (dict(min_p=0.1), dict(min_tokens=1), dict(logit_bias={0: 1}), dict(presence_penalty=0.1),
               dict(frequency_penalty=-0.1), dict(repetition_penalty=1.1)):
        assert SamplingParams(**kw).processed, kw


@pytest.mark.parametrize("kw,field", [
    (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"), (dict(min_tokens=17, max_tokens=16), "min_tokens"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(repetition_penalty=True), "repetition_penalty"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={1: 101}), "logit_bias"), (dict(logit_bias={-1: 1}), "logit_bias"), (dict(logit_bias=[1]), "logit_bias")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kw)


def test_logit_bias_ids_checked_against_the_vocabulary():
    SamplingParams(logit_bias={15: 1}).check_vocab(16)
    with pytest.raises(ValueError, match="logit_bias.*16"):
        SamplingParams(logit_bias={16: 1}).check_vocab(16)


KV = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
GREEDY = [dict(logit_bias={7: 6.0, 11: -5.0}), dict(min_p=0.3), dict(min_tokens=6, stop_token_ids=[7], logit_bias={7: 4.0}),
          dict(repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5)]


@pytest.fixture(scope="module")
def ck7(tmp_path_factory):
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("dsp7p"), seed=3, drafter="dspark", dspark_block_size=7)


@pytest.fixture(scope="module")
def pair(ck7):
    return LLM(ck7, **KV), LLM(ck7, speculative="dspark", num_speculative_tokens=4, **KV)


def _prompts(n, seed, lo=4, hi=40):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


@pytest.mark.parametrize("kw", GREEDY, ids=[",".join(k) for k in GREEDY])
def test_greedy_with_processors_same_with_speculation(pair, kw):
    "The same greedy tokens with DSpark on and off, and the processors really changed them (vs plain greedy)."
    base, spec = pair
    prompts = _prompts(2, seed=4)
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, **kw)
    ref = [o.outputs[0].token_ids for o in base.generate(prompts, sp, use_tqdm=False)]
    drafts0 = spec.spec_stats()["num_draft_tokens"]
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, sp, use_tqdm=False)] == ref
    assert spec.spec_stats()["num_draft_tokens"] > drafts0
    if kw.get("min_p"): return                                          # min_p never moves the argmax
    plain = [o.outputs[0].token_ids for o in base.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    assert ref != plain


def test_greedy_min_tokens_and_bias_by_hand(pair):
    "A +100 bias forces token 7; as a stop token it is masked for the first 3 tokens, then emitted and ends the request."
    for llm in pair:
        sp = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[7], min_tokens=3, logit_bias={7: 100.0})
        toks = llm.generate(_prompts(1, seed=5), sp, use_tqdm=False)[0].outputs[0].token_ids
        assert len(toks) == 4 and toks[-1] == 7 and 7 not in toks[:3], toks
        sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logit_bias={9: 100.0})
        assert llm.generate(_prompts(1, seed=5), sp, use_tqdm=False)[0].outputs[0].token_ids == [9] * 5


def test_stop_strings_wait_for_min_tokens(pair):
    "As in vLLM, no stop condition ends a request before `min_tokens`: a stop string that the text starts with neither."
    for llm in pair:
        p = _prompts(1, seed=6)
        text = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
        stop = text[:2]
        assert stop and llm.generate(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop]),
                                     use_tqdm=False)[0].outputs[0].text == ""
        out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop], min_tokens=5),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= 5 and out.text.startswith(stop), out


class Oracle:
    "A proposer whose drafts are a known continuation (deterministic, so its q is one-hot): every draft is accepted."
    def __init__(self, seqs, V):
        self.seqs, self.V = seqs, V
    def __call__(self, slot, rid, anchor, P, n, params, seed):
        seq = next((s for s in self.seqs if len(s) > P and s[P] == anchor), [])   # past the end: anything
        toks = (seq[P + 1:P + 1 + n] + [0] * n)[:n]
        return toks, torch.nn.functional.one_hot(torch.tensor(toks), self.V).float()


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=0.5),
                                dict(min_tokens=8, stop_token_ids=[7], logit_bias={7: 4.0})], ids=["penalties", "min_tokens"])
def test_greedy_rounds_count_the_drafts_before_each_row(ck7, pair, kw):
    """Drafts that are the processed greedy continuation are all accepted, and the output stays identical: row j
    of a round sees drafts 1..j-1 in its history (with the committed history only, the penalties at row j would
    differ and the round would diverge from non-speculative greedy)."""
    base, prompt = pair[0], _prompts(1, seed=6)[0]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, **kw)
    ref = base.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=4, **KV)
    spec.runner.proposer.propose = Oracle([prompt + ref], spec.model.cfg.vocab_size)
    spec.runner.proposer.propose_greedy = spec.runner.proposer.propose_sampled = None
    assert spec.generate([prompt], sp, use_tqdm=False)[0].outputs[0].token_ids == ref
    st = spec.spec_stats()
    pad = 1 if kw.get("min_tokens") else 0                   # the stop ends the reference: the last round's last draft is padding
    assert st["num_draft_tokens"] >= 8 and st["num_draft_tokens"] - st["num_accepted_tokens"] <= pad


@pytest.fixture(scope="module")
def v16(tmp_path_factory):
    ck = dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("v16p"), seed=5, drafter="dspark", vocab_size=16, dspark_block_size=3)
    return dspark.load_target(ck), LLM(ck, speculative="dspark", num_speculative_tokens=3, max_num_seqs=64,
                                       max_num_batched_tokens=1024, kv_cache_memory_bytes=64 * 2**20)


def _pvalue(x: torch.Tensor, exact: torch.Tensor) -> float:
    N = len(x)
    counts = torch.bincount(x, minlength=len(exact)).double()
    assert counts[exact == 0].sum() == 0, "emitted a token of probability 0"
    keep = exact * N >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([exact[keep], exact[~keep].sum(0, keepdim=True)]) * N
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    return float(torch.special.gammaincc(torch.tensor(int(keep.sum()) / 2.0), torch.tensor(chi2 / 2.0)))


DIST = [dict(repetition_penalty=2.5), dict(presence_penalty=2.0), dict(min_p=0.15), dict(logit_bias={3: 2.0, 5: 1.5, 0: -100})]


@pytest.mark.parametrize("kw", DIST, ids=[",".join(k) for k in DIST])
def test_speculative_samples_the_processed_target(v16, kw):
    """T = 1 on a 16-token vocabulary with DSpark drafting (K = 3): the first three generated tokens follow the
    processed target's exact marginals, enumerated from the target's logits with each position's own history.
    The third token is verified on a row whose history holds the round's first draft: it tests the per-position
    histories (a round that ignored them would use the wrong penalty there)."""
    target, spec = v16
    prompt, V = [0, 5, 9, 3], 16
    sp = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, **kw)
    P = lambda gen: processed_probs(target.logits(torch.tensor([prompt + gen]))[0, -1:], sp, [(prompt, gen)])[0].double()
    p1 = P([])
    p2 = torch.stack([P([x]) for x in range(V)])                       # [x, y]
    p3 = torch.stack([torch.stack([P([x, y]) for y in range(V)]) for x in range(V)])   # [x, y, z]
    m2, m3 = p1 @ p2, torch.einsum("x,xy,xyz->z", p1, p2, p3)
    N = 1200
    acc0 = spec.spec_stats()["num_accepted_tokens"]
    outs = spec.generate([prompt] * N, [SamplingParams(**(sp.__dict__ | dict(seed=s))) for s in range(N)], use_tqdm=False)
    x = torch.tensor([o.outputs[0].token_ids[:3] for o in outs])
    assert spec.spec_stats()["num_accepted_tokens"] - acc0 > 50       # the drafter's tokens are really being used
    for col, exact in enumerate((p1, m2, m3)):
        assert _pvalue(x[:, col], exact) > 1e-3, (col, kw)
