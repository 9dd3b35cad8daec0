"""Masked drafting (chapter 02b): a structured-outputs request's drafts come from the drafter's view masked by its
grammar, so every draft the engine verifies is one the grammar allows, and the mean acceptance length on the
embedded model's JSON is at least the unmasked drafter's. (The distribution oracle, masked and unmasked, is
`test_structured.test_speculative_samples_the_constrained_target`.)"""
import json

import numpy as np
import torch

import jsonschema
import llguidance as llg
import pytest

from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams
from dspark.sample.structured import grammar_of
from test_structured import SCHEMA


@pytest.fixture(scope="module")
def llm():
    return LLM(speculative="dspark", max_num_seqs=8)


def _run(llm, masked: bool, temperature: float):
    """Six JSON completions with drafts masked or not; returns the outputs, the counters, and every verified
    round's `(committed tokens, drafts)` as the runner saw them."""
    runner, seen = llm.engine.runner, []
    runner.masked_drafts, execute = masked, runner.execute
    def spy(batch):
        seen.extend((list(r.output_ids), list(r.drafts)) for r, _ in batch if r.drafts)
        return execute(batch)
    runner.execute, before = spy, llm.spec_stats()
    try:
        sp = [SamplingParams(temperature=temperature, max_tokens=48, seed=s, structured_outputs={"json": SCHEMA}) for s in range(6)]
        outs = llm.generate(["Data:", "x = ", "{", "def f():", "Config:", "#"], sp, use_tqdm=False)
    finally: runner.execute, runner.masked_drafts = execute, True
    after = llm.spec_stats()
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return outs, d, seen


def _forbidden(llm, seen) -> int:
    "Drafts the grammar forbids after the committed tokens and the drafts before them, over all rounds."
    g, bad = llm.engine.runner.grammars, 0
    for out, drafts in seen:
        m = llg.LLMatcher(g.tok, grammar_of({"json": SCHEMA}), log_level=0)
        assert all(m.consume_token(t) for t in out)
        bad += len(drafts) - m.validate_tokens(drafts)
    return bad


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_masked_drafts_are_grammatical_and_accepted_longer(llm, temperature):
    got = {}
    for masked in (True, False):
        outs, d, seen = _run(llm, masked, temperature)
        for o in outs:
            assert o.outputs[0].finish_reason == "stop", o
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
        got[masked] = dict(d, forbidden=_forbidden(llm, seen), rounds=len(seen),
                           mean_acceptance_length=1 + d["num_accepted_tokens"] / d["num_drafts"],
                           texts=[o.outputs[0].text for o in outs])
    print(temperature, {m: {k: v for k, v in g.items() if k != "texts"} for m, g in got.items()})
    assert got[True]["rounds"] > 0 and got[True]["forbidden"] == 0          # every verified draft is grammatical
    assert got[False]["forbidden"] > 0                                       # ... which unmasked drafts are not
    assert got[True]["mean_acceptance_length"] >= got[False]["mean_acceptance_length"]
    if temperature == 0: assert got[True]["texts"] == got[False]["texts"]   # greedy: lossless either way


@pytest.mark.slow
def test_verification_takes_the_walks_masks_and_they_equal_fresh_ones(llm, monkeypatch):
    """Each round's verify masks come from the draft walk that made its drafts (`DraftWalk.close` leaves them), and
    they equal the masks walked afresh from the committed tokens; six requests make the walk compute its masks on
    llguidance's thread pool."""
    from dspark.sample.structured import Grammars
    g, hits, fresh = llm.engine.runner.grammars, [], Grammars(llm.engine.tokenizer, llm.engine.runner.grammars.V)
    words = Grammars.mask_words
    def check(self, r, drafts):
        got, cached = words(self, r, drafts), self.walked.get(r.request_id)
        hit = cached is not None and cached[0] == len(r.output_ids) and len(cached[2]) > len(drafts)
        hits.append(hit)
        assert np.array_equal(got, words(fresh, r, drafts)), (r.request_id, len(r.output_ids), drafts)
        return got
    monkeypatch.setattr(Grammars, "mask_words", check)
    for temperature in (0.0, 1.0):
        outs, d, seen = _run(llm, True, temperature)
        assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert sum(hits) > len(hits) // 2 and len(seen) > 0
    assert g.walked == {}                                   # finished requests leave nothing behind


@pytest.mark.slow
def test_the_hidden_step_buffers_give_the_eager_drafts(llm):
    """The masked draft step's buffer layout (`DraftGraphs(masked=True)`, run eagerly with `capture=False`):
    constrained requests, greedy and sampled, get the tokens the eager masked proposer gives them."""
    from dspark.runtime.graphs import DraftGraphs
    pr = llm.engine.runner.proposer
    sp = [SamplingParams(temperature=t, max_tokens=40, seed=s, structured_outputs={"json": SCHEMA})
          for s, t in enumerate([0.0, 1.0, 1.0, 0.0, 1.0])]
    prompts = ["Data:", "x = ", "{", "def f():", "Config:"]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    before, pr.graphs = pr.graphs, DraftGraphs(pr, 8, capture=False, masked=True)
    try: got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally: replays, pr.graphs = pr.graphs.replays, before
    assert got == want and replays > 0
    with torch.enable_grad():                               # a capture runs with gradients on: the step turns them off
        t = lambda v: torch.tensor([v])
        assert not pr.draft_hidden(t(0), t(7), t(3))[0].requires_grad


@pytest.mark.slow
def test_greedy_grammar_steps_verify_by_the_masked_argmax(llm, monkeypatch):
    """Greedy requests under a grammar verify by the argmax of their masked rows (`grammar_greedy`), and get the tokens
    the sampled path's one-hot rejection sampling gives them."""
    from dspark.runtime import runner
    from dspark.sample.structured import Grammars
    sp = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs={"json": SCHEMA}) for _ in range(4)]
    prompts = ["Data:", "x = ", "{", "Config:"]
    calls, argmax = [], Grammars.masked_argmax
    monkeypatch.setattr(Grammars, "masked_argmax", lambda self, *a: calls.append(1) or argmax(self, *a))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    monkeypatch.setattr(runner, "grammar_greedy", lambda batch: None)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == want and len(calls) > 0


@pytest.mark.slow
def test_the_masked_markov_kernel_drafts_what_the_eager_loop_drafts(llm):
    """The fast path's masked greedy Markov loop (`markov_masked_greedy_triton`, here on Triton's interpreter: one
    launch a position reading the packed masks) drafts, round by round, exactly the eager masked loop's tokens, all
    of them grammatical, and the outputs are the same."""
    from dspark.kernels.markov import markov_masked_greedy_triton
    drafter, calls = llm.engine.runner.proposer.drafter, []
    sp = [SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"json": SCHEMA}) for _ in range(2)]
    def rounds():
        runner, seen, execute = llm.engine.runner, [], llm.engine.runner.execute
        def spy(batch):
            seen.extend((list(r.output_ids), list(r.drafts)) for r, _ in batch if r.drafts)
            return execute(batch)
        runner.execute = spy
        try: outs = llm.generate(["Data:", "{"], sp, use_tqdm=False)
        finally: runner.execute = execute
        return [o.outputs[0].token_ids for o in outs], seen
    want, eager = rounds()
    drafter.masked_kernel = lambda *a: calls.append(1) or markov_masked_greedy_triton(*a)
    try: got, fast = rounds()
    finally: drafter.masked_kernel = None
    assert got == want and fast == eager and len(calls) > 0 and len(fast) > 0
    assert _forbidden(llm, fast) == 0


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forced_positions_run_nothing_and_change_nothing(llm, temperature):
    """A draft position where every request's grammar allows one token (a JSON key, a quote, a brace) is drafted as
    that token without a Markov step (`DraftWalk.forced`): the masked law there is one-hot on it whatever the
    logits. Round by round the drafts, and the outputs, equal those with every position computed, greedy and
    sampled, with fewer Markov steps."""
    drafter = llm.engine.runner.proposer.drafter
    w2, steps = drafter.last.markov_head.markov_w2, []
    forward = w2.forward
    w2.forward = lambda x: steps.append(1) or forward(x)
    got = {}
    try:
        for skip in (True, False):
            drafter.skip_forced, steps[:] = skip, []
            outs, d, seen = _run(llm, True, temperature)
            got[skip] = ([o.outputs[0].token_ids for o in outs], seen, len(steps))
    finally: w2.forward, drafter.skip_forced = forward, True
    print(temperature, "Markov steps with and without skipping:", got[True][2], got[False][2])
    assert got[True][0] == got[False][0] and got[True][1] == got[False][1] and len(got[True][1]) > 0
    assert got[True][2] < got[False][2] // 2, (got[True][2], got[False][2])   # most JSON positions are forced


def test_confidence_logits_only_when_capacity_control_reads_them(llm):
    """The masked draft loop skips the confidence head when nothing reads it (`proposer.confidence` is None: no
    capacity control) and gives one logit a draft when something does; the drafts and tokens are the same."""
    pr = llm.engine.runner.proposer
    d, seen = pr.drafter, []
    masked = d.markov_masked
    def spy(*a, **k):
        out = masked(*a, **k)
        seen.append((k.get("conf", True), out[0], out[2]))
        return out
    sp = [SamplingParams(temperature=t, max_tokens=16, seed=1, structured_outputs={"json": SCHEMA}) for t in (0.0, 1.0)]
    d.markov_masked = spy
    try:
        off = [o.outputs[0].token_ids for o in llm.generate(["Data:", "{"], sp, use_tqdm=False)]
        without, seen[:] = list(seen), []
        pr.confidence = {}
        on = [o.outputs[0].token_ids for o in llm.generate(["Data:", "{"], sp, use_tqdm=False)]
    finally: d.markov_masked, pr.confidence = masked, None
    assert on == off and without and seen
    assert all(not flag and conf is None for flag, _, conf in without)
    assert all(flag and conf is not None and conf.shape == drafts.shape and torch.isfinite(conf).all() for flag, drafts, conf in seen)


def test_predicted_positions_run_nothing_and_change_nothing(llm):
    """Greedy masked drafting first makes the unmasked drafts (one Markov loop, one copy) and takes, at each position
    where every request still drafting has drafted them so far and its grammar allows its next one, that draft
    without a masked step (`DraftWalk.predict`): the masked argmax is then that token. One request at a time (a
    batch's position runs on the device if any request needs it): the drafts of every round, and the outputs,
    equal those of the plain masked loop, with fewer masked positions."""
    from dspark.sample.structured import DraftWalk
    pr, runner = llm.engine.runner.proposer, llm.engine.runner
    schemas = [{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["name", "age", "tags"], "additionalProperties": False}, SCHEMA]
    prompts = ["def parse_config(path):\n    ", "# JSON record\n", "import json\ndata = ", "class User:\n    "]
    forced, predict, counts, tries = DraftWalk.forced, DraftWalk.predict, [], []
    DraftWalk.forced = lambda self: counts.append(r := forced(self)) or r
    DraftWalk.predict = lambda self, d: tries.append(1) or predict(self, d)
    execute, got = runner.execute, {}
    try:
        for on in (True, False):
            pr.predict_drafts, pr.predict_idle, counts[:], tries[:], seen = on, 0, [], [], []
            def spy(batch, seen=seen):
                seen.extend((list(r.output_ids), list(r.drafts)) for r, _ in batch if r.drafts)
                return execute(batch)
            runner.execute = spy
            outs = [llm.generate([p], SamplingParams(temperature=0.0, max_tokens=64, structured_outputs={"json": s}),
                                 use_tqdm=False)[0].outputs[0].token_ids for s in schemas for p in prompts]   # C1
            got[on] = (outs, seen, sum(c is None for c in counts), len(tries))
    finally: DraftWalk.forced, DraftWalk.predict, runner.execute, pr.predict_drafts = forced, predict, execute, True
    print("masked positions (and unmasked passes) with and without predictions:", got[True][2:], got[False][2:])
    assert got[True][0] == got[False][0] and got[True][1] == got[False][1] and len(got[True][1]) > 20
    assert got[True][2] + got[True][3] < got[False][2] and got[False][3] == 0   # fewer waits for the device
