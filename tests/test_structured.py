"""Structured outputs (chapter 02b): sampled JSON valid for its schema with DSpark on and off, constrained DSpark
against the exactly enumerated constrained target, tool_choice 'required' through the openai client, and 400s."""
import json

import jsonschema
import pytest
import torch

import dspark
from dspark.entrypoints.llm import LLM
from dspark.sample.processors import processed_probs
from dspark.sample.sampling import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["a", "b", "c"]}, "tags": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 2},
    "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
              "required": ["x", "ok"], "additionalProperties": False}},
    "required": ["kind", "tags", "point"], "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.parametrize("spec", [None, "dspark"])
def test_sampled_json_matches_the_schema(spec):
    llm = LLM(speculative=spec, max_num_seqs=100)
    sp = [SamplingParams(temperature=1.0, max_tokens=48, seed=s, structured_outputs={"json": SCHEMA}) for s in range(100)]
    outs = llm.generate(["Data:"] * 100, sp, use_tqdm=False)
    for o in outs:
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    if spec: assert llm.spec_stats()["num_draft_tokens"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_constrained_rounds_on_the_gpu_keep_the_schema():
    """The GPU path of constrained DSpark, which the CPU never takes (mask rows written once into pinned memory, the
    one-launch masked argmax, MaskedSteps' mapped buffers, the draft walk's mask block): greedy and sampled
    completions in one batch are all complete documents of the schema."""
    llm = LLM(speculative="dspark", device="cuda", dtype="bfloat16", max_num_seqs=40,
              kv_cache_memory_bytes=2 ** 30)        # its own budget: engines of earlier tests may still hold memory
    sp = [SamplingParams(temperature=0.0 if s < 8 else 1.0, max_tokens=48, seed=s, structured_outputs={"json": SCHEMA})
          for s in range(40)]
    for o in llm.generate([f"Data {s}:" for s in range(40)], sp, use_tqdm=False):
        c = o.outputs[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.spec_stats()["num_draft_tokens"] > 0


@pytest.fixture(scope="module")
def v16(tmp_path_factory):
    ck = dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("v16s"), seed=5, drafter="dspark", vocab_size=16, dspark_block_size=3)
    return dspark.load_target(ck), LLM(ck, speculative="dspark", num_speculative_tokens=3, max_num_seqs=64,
                                       max_num_batched_tokens=1024, kv_cache_memory_bytes=64 * 2**20)


def _pvalue(x, exact):
    N = len(x)
    counts = torch.bincount(x, minlength=len(exact)).double()
    assert counts[exact == 0].sum() == 0, "emitted a token the grammar forbids"
    keep = exact * N >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
    exp = torch.cat([exact[keep], exact[~keep].sum(0, keepdim=True)]) * N
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
    return float(torch.special.gammaincc(torch.tensor(int(keep.sum()) / 2.0), torch.tensor(chi2 / 2.0)))


def _constrained_pvalues(v16, N: int = 1200) -> list[float]:
    """Chi-square p-values of `N` constrained samples from the v16 engine against the exact masked target: the first
    three tokens' marginals, then their joint law."""
    target, spec = v16
    A, B, C = [3, 5, 7, 9], [2, 4, 6], [1, 3, 5, 8, 11]
    lark = "start: a b c c\na: " + " | ".join(f"<[{t}]>" for t in A) + "\nb: " + " | ".join(f"<[{t}]>" for t in B) + \
           "\nc: " + " | ".join(f"<[{t}]>" for t in C)
    prompt, V = [0, 5, 9, 3], 16
    sp = SamplingParams(temperature=1.0, max_tokens=4, structured_outputs={"grammar": lark})
    allow = lambda S: torch.zeros(1, V, dtype=torch.bool).index_fill_(1, torch.tensor(S), True)
    P = lambda gen, S: processed_probs(target.logits(torch.tensor([prompt + gen]))[0, -1:], sp, [(prompt, gen)], (), allow(S))[0].double()
    p1 = P([], A)
    p2 = torch.stack([P([x], B) if x in A else torch.zeros(V, dtype=torch.float64) for x in range(V)])
    p3 = torch.stack([torch.stack([P([x, y], C) if x in A and y in B else torch.zeros(V, dtype=torch.float64)
                                   for y in range(V)]) for x in range(V)])
    m2, m3 = p1 @ p2, torch.einsum("x,xy,xyz->z", p1, p2, p3)
    outs = spec.generate([prompt] * N, [SamplingParams(**(sp.__dict__ | dict(seed=s))) for s in range(N)], use_tqdm=False)
    x = torch.tensor([o.outputs[0].token_ids[:3] for o in outs])
    joint = torch.einsum("x,xy,xyz->xyz", p1, p2, p3).reshape(-1)
    return [_pvalue(x[:, col], exact) for col, exact in enumerate((p1, m2, m3))] + \
           [_pvalue(x[:, 0] * V * V + x[:, 1] * V + x[:, 2], joint)]


@pytest.mark.slow
@pytest.mark.parametrize("masked", [True, False])
def test_speculative_samples_the_constrained_target(v16, masked):
    """T = 1, 16 tokens, DSpark K = 3, a token-level grammar, drafts from the drafter's masked view (`masked`, the
    default) or its unmasked one: the first three tokens follow the exact marginals of the masked target (each
    position masked by the grammar state after the tokens before it), and their joint law the exact product
    p1(x) p2(y | x) p3(z | x, y) over all 16³ triples (cells expecting fewer than 5 of the 1,200 samples pooled into
    one). Each chi-square test fails an exact sampler with probability about 1e-3 (the seeds are fixed, so the
    outcome is too); `test_the_oracle_sees_a_wrong_q` shows it fails a sampler whose q is not the drafts' law."""
    v16[1].engine.runner.masked_drafts = masked
    try: pv = _constrained_pvalues(v16)
    finally: v16[1].engine.runner.masked_drafts = True
    print("masked" if masked else "unmasked", [f"{p:.3g}" for p in pv])
    assert min(pv) > 1e-3, pv


@pytest.mark.slow
def test_the_oracle_sees_a_wrong_q(v16, monkeypatch):
    """The oracle's power: masked drafts verified against a q that is not the law they were drawn from (halfway to
    uniform on its support, a plausible bookkeeping slip) sample a different law, and the chi-square tests say so."""
    from dspark.spec.proposers import DSparkProposer
    right = DSparkProposer.draft_probs
    def wrong(self, reqs, K):
        q = right(self, reqs, K)
        return 0.5 * q + 0.5 * (q > 0) / (q > 0).sum(-1, keepdim=True).clamp_min(1)
    monkeypatch.setattr(DSparkProposer, "draft_probs", wrong)
    pv = _constrained_pvalues(v16)
    print("wrong q", [f"{p:.3g}" for p in pv])
    assert min(pv) < 1e-3, pv


@pytest.mark.parametrize("bad,field", [({"json": {"type": "foo"}}, "structured_outputs"), ({"regex": "a("}, "structured_outputs"),
                                       ({"choice": []}, "structured_outputs"), ({"structural_tag": {}}, "structured_outputs"),
                                       ({"json": {}, "regex": "a"}, "structured_outputs")])
def test_bad_specs_name_the_field(bad, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(structured_outputs=bad)


def test_choice_and_regex_are_honoured():
    llm = LLM(max_num_seqs=16)
    outs = llm.generate(["x"] * 8, [SamplingParams(temperature=1.0, max_tokens=8, seed=s, structured_outputs={"choice": ["yes", "no"]})
                                    for s in range(8)], use_tqdm=False)
    assert {o.outputs[0].text for o in outs} <= {"yes", "no"} and all(o.outputs[0].finish_reason == "stop" for o in outs)
    outs = llm.generate(["x"] * 8, [SamplingParams(temperature=1.0, max_tokens=8, seed=s, structured_outputs={"regex": "[0-9]{3}"})
                                    for s in range(8)], use_tqdm=False)
    assert all(len(o.outputs[0].text) == 3 and o.outputs[0].text.isdigit() for o in outs)


def test_a_choice_of_many_strings_is_honoured():
    "20,000 choices: one lexer terminal, not 20,000 parser alternatives (which overflow llguidance's Earley row)."
    choices = [f"opt{i}" for i in range(20000)]
    llm = LLM(max_num_seqs=4)
    outs = llm.generate(["x"] * 4, [SamplingParams(temperature=1.0, max_tokens=16, seed=s, structured_outputs={"choice": choices})
                                    for s in range(4)], use_tqdm=False)
    assert all(o.outputs[0].text in choices and o.outputs[0].finish_reason == "stop" for o in outs)


@pytest.mark.parametrize("spec", [None, "dspark"])
def test_a_complete_grammar_ends_before_min_tokens(spec):
    """`min_tokens` hides the end of sequence, but a grammar that allows nothing else ends the output there: the
    request finishes with the grammar's text (it failed with token 0 breaking the grammar)."""
    llm = LLM(speculative=spec, max_num_seqs=4)
    sp = [SamplingParams(temperature=t, max_tokens=30, min_tokens=20, seed=1, structured_outputs={"choice": ["yes", "no"]})
          for t in (0.0, 1.0)]
    for o in llm.generate(["x", "x"], sp, use_tqdm=False):
        assert o.outputs[0].text in ("yes", "no") and o.outputs[0].finish_reason == "stop", o.outputs[0]
