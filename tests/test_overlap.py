"""Overlapped greedy decoding (chapter 25) on the CPU, with each captured graph emulated by rerunning its step on
the runner's persistent buffers: whatever the engine schedules, the tokens, finish reasons and streamed text
must be the synchronous engine's, and steps computed ahead must really be used."""
import pytest

import dspark
from dspark.runtime.overlap import DecodeAhead
from dspark.sample.sampling import SamplingParams
from test_graph_context import emulate_graphs, use_references

PROMPTS = [list(range(5, 21)), list(range(30, 37)), list(range(40, 71))]


def engine(ckpt, overlap: bool, **kw):
    llm = dspark.LLM(ckpt, max_num_seqs=4, max_model_len=128, block_size=16, kv_cache_memory_bytes=16 * 2**20,
                     enable_prefix_caching=False, **{k: v for k, v in kw.items() if k != "lookahead"})
    g = emulate_graphs(llm, 4)
    if overlap:                                    # what LLM sets up on CUDA: the stand-in graphs came later
        llm.runner.ahead = DecodeAhead(g, llm.max_model_len)
        llm.runner.ahead.admits = llm.scheduler.would_admit
        llm.scheduler.sc.lookahead = kw.get("lookahead", 1)
    return llm


def run(llm, params, events=None, steps: int = 200):
    """Step to the end; `events[step](llm, ids)` runs before that step (arrivals, aborts). Returns each request's
    (token ids, finish reason, text joined from its deltas)."""
    ids = [llm.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    text = {}
    for step in range(steps):
        if events and step in events: events[step](llm, ids)
        if not llm.has_unfinished_requests(): break
        for d in llm.step(): text[d.request_id] = text.get(d.request_id, "") + d.text
    outs = {}
    for i in ids:
        if i in llm._tracks:
            o = llm.pop_output(i).outputs[0]
            outs[i] = (o.token_ids, o.finish_reason, text.get(i, ""))
    return outs


def greedy(*max_tokens, **kw):
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, **kw) for m in max_tokens]


def test_overlap_gives_the_synchronous_tokens_and_text(tiny_ckpt, monkeypatch):
    use_references(monkeypatch)
    params = greedy(40, 23, 31)
    first = run(engine(tiny_ckpt, False), params)
    stop = first["1"][0][12]                                    # request 1 now stops on a token it emits mid-run
    params[1] = SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop], ignore_eos=True)
    late = lambda llm, ids: ids.append(llm.add_request(list(range(80, 92)), greedy(20)[0]))
    sync = run(engine(tiny_ckpt, False), params, {9: late})
    llm = engine(tiny_ckpt, True)
    over = run(llm, params, {9: late})
    assert over == sync and len(over) == 4
    assert over["1"][0][-1] == stop and len(over["1"][0]) < 23 and over["1"][1] == "stop"
    ahead = llm.runner.ahead
    assert ahead.used > 20 and ahead.dropped == 0                # the arrival waited one step instead of dropping one
    assert all(o[2] for o in over.values())                     # streamed text (per step) is there, and equal


def test_sampled_requests_keep_the_synchronous_path(tiny_ckpt, monkeypatch):
    "While a sampled request shares the batch no step is computed ahead; once it finishes the greedy ones overlap."
    use_references(monkeypatch)
    params = greedy(30, 30) + [SamplingParams(temperature=1.0, max_tokens=8, seed=5, ignore_eos=True)]
    sync = run(engine(tiny_ckpt, False), params)
    llm = engine(tiny_ckpt, True)
    assert run(llm, params) == sync
    assert 10 < llm.runner.ahead.used < 29


def test_aborts_and_preemption_keep_the_tokens(tiny_ckpt, monkeypatch):
    """An abort while a step computed ahead includes the request, and a KV cache small enough that the scheduler
    preempts (freeing blocks the step computed ahead wrote into): the survivors' tokens are the synchronous ones."""
    use_references(monkeypatch)
    params = greedy(60, 60, 60)
    abort = {14: lambda llm, ids: llm.abort_request(ids[1])}
    for kw in ({}, {"num_kv_blocks": 9}):
        sync = run(engine(tiny_ckpt, False, **kw), params, abort)
        llm = engine(tiny_ckpt, True, **kw)
        assert run(llm, params, abort) == sync and set(sync) == {"0", "2"}
        assert llm.runner.ahead.used > 20
        if kw: assert llm.scheduler.num_preemptions > 0


def test_without_blocks_a_step_ahead_nothing_is_launched_that_would_be_dropped(tiny_ckpt, monkeypatch):
    """With no lookahead allocation, requests of staggered lengths cross block boundaries on different steps: the
    step computed ahead is skipped then (launching it without a request would get it dropped), and the tokens
    are still the synchronous ones."""
    use_references(monkeypatch)
    params = greedy(40, 23, 31)
    sync = run(engine(tiny_ckpt, False), params)
    llm = engine(tiny_ckpt, True, lookahead=0)
    assert run(llm, params) == sync
    assert llm.runner.ahead.dropped == 0 and llm.runner.ahead.used > 10


def test_engine_switch(tiny_ckpt):
    llm = dspark.LLM(tiny_ckpt, max_num_seqs=2, kv_cache_memory_bytes=16 * 2**20, overlap_decode=True)
    assert llm.runner.ahead is None                              # CPU: no graphs, nothing to overlap
    from dspark.entrypoints.serve import parse_args
    assert parse_args(["--model", str(tiny_ckpt)]).overlap_decode
    assert not parse_args(["--model", str(tiny_ckpt), "--no-overlap-decode"]).overlap_decode


def spy_run(llm, prompts, params, late=None):
    """Three requests (and `prompts[3]` arriving at step `late`) run step by step: their outputs, and the drafts
    each step verified, request by request."""
    seen, schedule = [], llm.scheduler.schedule
    def spy(**kw):
        batch = schedule(**kw); seen.append({r.request_id: list(r.drafts) for r, _ in batch}); return batch
    llm.scheduler.schedule = spy
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts[:3], params)]
    for step in range(200):
        if late is not None and step == late: ids.append(llm.add_request(prompts[3], params[0]))
        if not llm.has_unfinished_requests(): break
        llm.step()
    return [llm.pop_output(i).outputs[0] for i in ids], seen


def test_dspark_rounds_launched_ahead_match_the_synchronous_rounds(monkeypatch):
    """The trained default model with fused rounds (emulated as in test_fused_round): launching each round before
    the host's bookkeeping of the last one changes no token, draft or acceptance count. Rooms shrink at the end
    (max_tokens), one request stops on a token mid-run, and a request arriving mid-run waits one round (the round
    launched ahead is taken, nothing more is launched while it waits) instead of dropping one."""
    from dspark.tools.capacity_sweep import sweep_prompts
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.runtime.graphs import DraftGraphs
    from dspark.runtime.overlap import RoundAhead
    from test_fused_round import emulate_rounds
    use_references(monkeypatch)
    prompts = [p[:n] for p, n in zip(sweep_prompts(DEFAULT_MODEL, 4, 40), (40, 23, 31, 12))]
    engines = []
    def go(ahead: bool, params, late=None, capacity=None):
        llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=3, max_num_seqs=4, max_model_len=128,
                         kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False, capacity=capacity)
        rounds = emulate_rounds(llm)
        engines.append(llm)
        if ahead:       # and the draft step's graphs (emulated: run eagerly on their buffers), read late at a start
            llm.runner.round_ahead, llm.scheduler.sc.lookahead = RoundAhead(rounds, llm.max_model_len), 3 + 1
            llm.runner.round_ahead.admits = llm.scheduler.would_admit
            llm.runner.proposer.graphs = DraftGraphs(llm.runner.proposer, 4, capture=False)
        outs, seen = spy_run(llm, prompts, params, late)
        return [(o.token_ids, o.finish_reason) for o in outs], llm.runner.stats, seen, llm.runner.round_ahead
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 9, 25)]
    stop = go(False, params)[0][2][0][10]                    # a token request 2 emits: it stops there now
    params[2] = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True, stop_token_ids=[stop])
    sync = go(False, params, late=4)
    outs, stats, seen, ahead = go(True, params, late=4)
    assert outs == sync[0] and outs[2][1] == "stop" and outs[2][0][-1] == stop
    assert stats == sync[1] and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert ahead.used >= 4 and ahead.dropped == 0
    assert 0 < ahead.rounds.advanced < ahead.used     # laid out on the device in the steady state, by the host otherwise
    assert ahead.first >= 1                           # a first round launched behind the draft step, after a prefill
    late = [i for i, b in enumerate(seen) if "3" in b][0]       # the arrival's first step: one later than without
    assert late == [i for i, b in enumerate(sync[2]) if "3" in b][0] + 1
    assert seen[:late - 1] == sync[2][:late - 1]                # before it, the same steps, and at its step
    assert seen[late - 1] == {k: v for k, v in sync[2][late - 1].items() if k != "3"}   # the same rounds without it
    # capacity control, active from 3 requests (the threshold policy: its cuts depend on the confidences alone) and
    # bypassed below: rounds are launched ahead only while it is bypassed, and the tokens, acceptance and what was
    # scheduled are the synchronous capacity engine's
    from dspark.spec.controller import CapacityConfig
    cap = lambda: CapacityConfig(policy="threshold", threshold=0.5, activation=3, sps=[(B, 1.0) for B in range(1, 64)])
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 9, 25)]
    sync = go(False, params, capacity=cap())
    outs, stats, seen, ahead = go(True, params, capacity=cap())
    assert outs == sync[0] and stats == sync[1] and seen == sync[2]
    assert any(len(b) == 3 and any(len(d) < 3 for d in b.values()) for b in seen)   # it cut drafts at 3 requests
    assert ahead.used >= 4 and ahead.dropped == 0
    # active with the lagged policy (decided on the device): a round is launched ahead whenever the budget it admits
    # by, two decisions old, keeps every draft; on a flat curve it always does, and the steps are the synchronous
    # engine's. On a steep one it cuts some steps; a round launched ahead has its drafts decided before the host's
    # last decision, on the budget one decision older than the synchronous engine's, so only the tokens must agree
    for sps, cuts in (([(B, 1.0) for B in range(1, 64)], False), ([(B, 1.0 / (1.0 + 0.05 * B)) for B in range(1, 64)], True)):
        cap = lambda: CapacityConfig(policy="lagged", activation=1, sps=sps, online_sts=False, dynamic_depth=False)
        sync = go(False, params, capacity=cap())
        outs, stats, seen, ahead = go(True, params, capacity=cap())
        assert outs == sync[0] and (cuts or (stats == sync[1] and seen == sync[2]))
        cs = engines[-1].runner.capacity.stats
        assert cs.active_steps > 0 and cs.device_decisions > 0 and (cs.kept < cs.proposed) == cuts
        # a guess can miss where the decision's inputs move after the launch (a request ends, a room shrinks): the
        # engine then drops that round and runs the step as scheduled
        assert ahead.used >= (4 if cuts else 10) and ahead.dropped <= (ahead.used // 4 if cuts else 0)


def test_mtp_rounds_launched_ahead_match_the_synchronous_rounds(monkeypatch):
    """MTP through the same machinery (fused rounds emulated as in test_fused_round, its first drafts from its
    uncaptured graphs): launching each round before the host's bookkeeping of the last one changes no token, draft
    or acceptance count, with rooms shrinking at the end and a request arriving mid-run."""
    from dspark.tools.capacity_sweep import sweep_prompts
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.runtime.mtp_graphs import MTPGraphs
    from dspark.runtime.overlap import RoundAhead
    from test_fused_round import emulate_rounds
    use_references(monkeypatch)
    prompts = [p[:n] for p, n in zip(sweep_prompts(DEFAULT_MODEL, 4, 40), (40, 23, 31, 12))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 9, 25)]
    def go(ahead: bool):
        llm = dspark.LLM(DEFAULT_MODEL / "mtp", speculative="mtp", num_speculative_tokens=2, max_num_seqs=4,
                         max_model_len=128, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
        rounds = emulate_rounds(llm)
        llm.runner.proposer.graphs = MTPGraphs(llm.runner.proposer, 4, capture=False)
        if ahead:
            llm.runner.round_ahead, llm.scheduler.sc.lookahead = RoundAhead(rounds, llm.max_model_len), 2 + 1
            llm.runner.round_ahead.admits = llm.scheduler.would_admit
        outs, seen = spy_run(llm, prompts, params, late=4)
        return [o.token_ids for o in outs], llm.runner.stats, seen, llm.runner.round_ahead, rounds
    sync, got = go(False), go(True)
    assert got[0] == sync[0] and got[1] == sync[1] and 0 < got[1].num_accepted_tokens < got[1].num_draft_tokens
    assert sync[4].replays > 10 and got[3].used >= 4 and got[3].dropped == 0 and got[3].rounds.advanced > 0


def test_plain_switch_prefers_the_faster_mode_and_probes_the_other():
    "`PlainSwitch` on synthetic rates: learns drafting, then plain, keeps the faster, probes, and needs the margin."
    from dspark.spec.online import PlainSwitch
    sw = PlainSwitch(margin=0.05, probe_every=10, probe_len=2, wide=1.0)   # a 1.67x lead: not "wide" here
    rate = {False: 3.0, True: 5.0}                  # tokens per ms: plain decoding is faster at this load
    modes = []
    for _ in range(60):
        plain = sw.decide(64)
        modes.append(plain)
        sw.record(64, plain, int(rate[plain] * 10), 10.0)
    assert modes[0] is False and True in modes[:8]           # drafting first, then plain is tried
    tail = modes[20:]
    assert tail.count(True) > 0.7 * len(tail) and False in tail   # mostly plain, with probes of drafting
    sw.reset()
    for _ in range(40):                                      # 3% apart: inside the margin, drafting stays
        plain = sw.decide(64); sw.record(64, plain, 103 if plain else 100, 10.0)
    assert not sw.preferred
    assert PlainSwitch.bucket(1) == 1 and PlainSwitch.bucket(33) == 64 and PlainSwitch.bucket(64) == 64



def test_plain_switch_stops_probing_soon_when_one_mode_leads_widely():
    """A probe that confirms the preference by the `wide` lead (here drafting 1.67x plain) sets the interval to its
    maximum at once; within the margin but short of the wide lead (1.2x), it doubles as before."""
    from dspark.spec.online import PlainSwitch
    for draft_rate, every in ((5.0, 512), (3.6, 256)):       # 1.2x: 64 -> 128 -> 256 after two probes
        sw = PlainSwitch(probe_every=64, probe_len=2, max_probe_every=512)
        for _ in range(300):
            plain = sw.decide(64)
            sw.record(64, plain, int((3.0 if plain else draft_rate) * 10), 10.0)
        assert not sw.preferred and sw.every == every, (draft_rate, sw.every)


def test_plain_switch_needs_samples_and_backs_off_its_probes():
    """One fast plain step does not make plain decoding preferred (a rate needs `min_samples` steps, averaged), and
    while probes keep confirming drafting they come half as often each time, down to `max_probe_every`."""
    from dspark.spec.online import PlainSwitch
    sw = PlainSwitch(probe_every=8, probe_len=2, max_probe_every=64)
    plain_rates = iter([10.0] + [3.0] * 1000)             # the first plain step measured fast, the rest slow
    modes = []
    for _ in range(400):
        plain = sw.decide(64)
        modes.append(plain)
        sw.record(64, plain, int((next(plain_rates) if plain else 5.0) * 10), 10.0)
    assert not sw.preferred and sw.every == 64
    starts = [i for i in range(1, len(modes)) if modes[i] and not modes[i - 1]]   # each probe of plain decoding
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps == sorted(gaps) and gaps[-1] > 4 * gaps[0], gaps
    assert sum(modes) < 0.1 * len(modes)

def test_capacity_depth_zero_decodes_plainly_and_resumes_drafting(monkeypatch):
    """Capacity control's depth 0 (emulated graphs): scripted plain/draft decisions; plain steps run as overlapped
    decode steps (`DecodeAhead`, the graphs writing the drafter's context), drafting resumes with rounds, and the
    tokens, acceptance and every scheduled batch equal the synchronous engine's with the same decisions."""
    from dspark.spec.controller import CapacityConfig
    from dspark.spec.online import PlainSwitch
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.tools.capacity_sweep import sweep_prompts
    from dspark.runtime.overlap import DecodeAhead, RoundAhead
    from test_fused_round import emulate_rounds
    use_references(monkeypatch)
    script = [False] * 3 + [True] * 8 + [False] * 6 + [True] * 5 + [False] * 100
    def go(ahead: bool):
        calls = iter(script)
        def decide(self, R):
            self.plain = next(calls); return self.plain
        monkeypatch.setattr(PlainSwitch, "decide", decide)
        llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=3, max_num_seqs=4, max_model_len=128,
                         kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False,
                         capacity=CapacityConfig(policy="threshold", sps=[(B, 1.0) for B in range(1, 64)], coast=0,
                                                 plain_switch=True))   # a
        # decision every step: the script is the switch's, step by step (coasting has its own test, test_capacity)
        cap = llm.runner.capacity
        cap.activation = 1                                   # the switch runs at every size (the knee is automatic)
        rounds = emulate_rounds(llm)
        if ahead:
            llm.runner.round_ahead = RoundAhead(rounds, llm.max_model_len)
            llm.runner.ahead = DecodeAhead(rounds.g, llm.max_model_len, gate=llm.runner._plain)
            llm.scheduler.sc.lookahead = 3 + 1
        seen, schedule = [], llm.scheduler.schedule
        def spy(**kw):
            batch = schedule(**kw); seen.append({r.request_id: list(r.drafts) for r, _ in batch}); return batch
        llm.scheduler.schedule = spy
        prompts = [p[:n] for p, n in zip(sweep_prompts(DEFAULT_MODEL, 2, 40), (40, 23))]
        sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 30)]
        outs = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, sp, use_tqdm=False)]
        return outs, llm.runner.stats, seen, llm.runner, cap.stats
    sync = go(False)
    outs, stats, seen, runner, cs = go(True)
    plain_eng = dspark.LLM(DEFAULT_MODEL, max_num_seqs=4, max_model_len=128, kv_cache_memory_bytes=16 * 2**20)
    prompts = [p[:n] for p, n in zip(sweep_prompts(DEFAULT_MODEL, 2, 40), (40, 23))]
    ref = [o.outputs[0].token_ids for o in plain_eng.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 30)], use_tqdm=False)]
    assert [t for t, _ in outs] == ref                       # greedy: exactly the non-speculative tokens
    assert outs == sync[0] and stats == sync[1] and seen == sync[2]
    flags = [not any(b.values()) for b in seen if len(b) == 2]   # steps of both requests without any draft
    assert sum(flags) >= 8 and any(flags[i] and not flags[i + 1] for i in range(len(flags) - 1))   # and drafting resumed
    assert runner.ahead.used >= 4 and runner.round_ahead.used >= 2 and cs.plain_steps >= 8


def test_capacity_records_only_steps_that_keep_their_mode():
    """`CapacityController._switch`: a step is fed to the switch with its committed tokens and mode, except a step
    that changes mode (a plain step that proposed drafts, a round that proposed none), whose cost is the switch's,
    and a step that admitted a request, whose cost is its prefill's."""
    from types import SimpleNamespace
    from dspark.spec.capacity import SPSCurve
    from dspark.spec.controller import CapacityConfig, CapacityController
    cap = CapacityController(CapacityConfig(policy="scheduler", plain_switch=True), 5, SPSCurve([(1, 1.0), (96, 1.0)], capture_limit=96),
                             [1, 8, 96], 16)
    cap.activation = 1
    got = []
    cap.switch.record = lambda R, plain, tokens, ms: got.append((R, plain, tokens))
    cap.switch.decide = lambda R: False
    st = SimpleNamespace(num_drafts=0, num_accepted_tokens=0)
    runner = SimpleNamespace(stats=st)
    reqs = lambda drafts, first=0: [SimpleNamespace(drafts=list(drafts), request_id=f"r{i}") for i in range(first, first + 4)]
    cap._switch(reqs([1, 2]), runner)                        # the first decision only marks the time
    st.num_drafts, st.num_accepted_tokens = 4, 6             # a round: 4 requests, 6 drafts accepted
    cap._switch(reqs([1, 2]), runner)                        # ... that proposed drafts again: recorded
    st.num_drafts, st.num_accepted_tokens = 8, 9
    cap._switch(reqs([]), runner)                            # a round that proposed none: the switch's cost
    cap._switch(reqs([]), runner)                            # a plain step, proposing none: recorded
    cap._switch(reqs([3]), runner)                           # a plain step that proposed drafts: not recorded
    assert got == [(4, False, 10), (4, True, 4)]
    st.num_drafts, st.num_accepted_tokens = 12, 12
    cap._switch(reqs([3], first=1), runner)                  # a round in which r4 arrived (its prefill): not recorded
    st.num_drafts, st.num_accepted_tokens = 16, 14           # that round: 4 requests, 2 drafts accepted
    cap._switch(reqs([3], first=1)[:3], runner)              # the next: r4 finished, nobody arrived: recorded
    assert got[2:] == [(3, False, 5)]


def test_steady_load_drops_no_step(tiny_ckpt, monkeypatch):
    """A client keeping 3 of 7 requests in flight (the bench's `--waves`): every finish brings an arrival, which waits
    one step behind the step launched ahead instead of dropping it. The tokens are the synchronous engine's."""
    from dspark.tools.bench import timed_batch
    use_references(monkeypatch)
    prompts = [list(range(5 + i, 17 + i)) for i in range(7)]
    params = greedy(*(9 + 4 * i for i in range(7)))
    sync = timed_batch(engine(tiny_ckpt, False), prompts, params, False, "cpu", concurrency=3)[2]
    llm = engine(tiny_ckpt, True)
    over = timed_batch(llm, prompts, params, False, "cpu", concurrency=3)[2]
    assert [o.outputs[0].token_ids for o in over] == [o.outputs[0].token_ids for o in sync]
    assert llm.runner.ahead.dropped == 0 and llm.runner.ahead.used > 40


def test_would_admit(tiny_ckpt):
    "The scheduler's forecast that the runner consults before launching a step ahead: a seat and blocks for the arrival."
    llm = dspark.LLM(tiny_ckpt, max_num_seqs=2, max_model_len=256, block_size=16, num_kv_blocks=6,
                     kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
    s = llm.scheduler
    assert not s.would_admit(0)                                  # nobody waiting
    llm.add_request(list(range(5, 40)), greedy(4)[0])            # 35 tokens: 3 blocks
    assert s.would_admit(0) and s.would_admit(1) and not s.would_admit(2)   # no seat at 2 running
    llm.add_request(list(range(5, 40)), greedy(4)[0])
    llm.step()                                                   # both admitted: 6 of 6 blocks held
    llm.add_request(list(range(5, 40)), greedy(4)[0])
    assert not s.would_admit(0)                                  # a seat but no blocks


def test_no_round_is_launched_ahead_for_a_processed_greedy_request(monkeypatch):
    """A round launched ahead is verified by the target's raw argmax. A greedy request whose distribution is
    processed (here a repetition penalty that changes its tokens) must not get one: with rounds launched ahead,
    a batch of a plain and a penalised request on the same prompt decodes exactly as the synchronous engine."""
    from dspark.tools.capacity_sweep import sweep_prompts
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.runtime.graphs import DraftGraphs
    from dspark.runtime.overlap import RoundAhead
    from test_fused_round import emulate_rounds
    use_references(monkeypatch)
    prompt = sweep_prompts(DEFAULT_MODEL, 1, 24)[0][:24]
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=2.0)]
    def go(ahead: bool) -> list[list[int]]:
        llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=3, max_num_seqs=2, max_model_len=64,
                         kv_cache_memory_bytes=8 * 2**20, enable_prefix_caching=False)
        rounds = emulate_rounds(llm)
        if ahead:
            llm.runner.round_ahead, llm.scheduler.sc.lookahead = RoundAhead(rounds, llm.max_model_len), 3 + 1
            llm.runner.round_ahead.admits = llm.scheduler.would_admit
            llm.runner.proposer.graphs = DraftGraphs(llm.runner.proposer, 2, capture=False)
        return [o.outputs[0].token_ids for o in llm.generate([prompt, prompt], params, use_tqdm=False)]
    sync = go(False)
    assert sync[0] != sync[1]                                # the penalty changes what greedy decoding picks
    assert go(True) == sync


def test_constrained_and_simulated_verify_steps_launched_ahead_match_the_synchronous_steps(monkeypatch):
    """Verify steps that no fused round runs, launched by the runner as soon as their drafts are on the host
    (`VerifyAhead`): greedy requests under a JSON schema (drafted from the grammar-masked view) beside a plain one,
    and plain requests under simulated acceptance. Each engine gives the synchronous engine's tokens, drafts and
    acceptance counts, rooms shrinking at the end, and (greedy) a request arriving mid-run, which waits a step; the
    steps launched ahead are taken, and the constrained rows' argmax is the grammar-masked one (the JSON parses).
    Simulated acceptance draws from one stream in step order, so an arrival that waits a step changes its draws:
    that run has none."""
    import json
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.runtime.overlap import VerifyAhead
    from dspark.tools.capacity_sweep import sweep_prompts
    use_references(monkeypatch)
    schema = {"type": "object", "properties": {"id": {"type": "integer"}, "tag": {"enum": ["red", "green"]}},
              "required": ["id", "tag"], "additionalProperties": False}
    prompts = [p[:n] for p, n in zip(sweep_prompts(DEFAULT_MODEL, 4, 40), (40, 23, 31, 12))]
    def go(ahead: bool, params, simulate=None, late=3):
        llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=3, max_num_seqs=4, max_model_len=128,
                         kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False, simulate_acceptance=simulate)
        g = emulate_graphs(llm, 4)
        if ahead:
            llm.runner.verify_ahead, llm.scheduler.sc.lookahead = VerifyAhead(g, llm.max_model_len), 3 + 1
            llm.runner.verify_ahead.admits = llm.scheduler.would_admit
        outs, seen = spy_run(llm, prompts, params, late=late)
        return [(o.token_ids, o.finish_reason, o.text) for o in outs], llm.runner.stats, seen, llm.runner.verify_ahead
    js = lambda m: SamplingParams(temperature=0.0, max_tokens=m, structured_outputs={"json": schema})
    params = [js(40), SamplingParams(temperature=0.0, max_tokens=19, ignore_eos=True), js(33)]
    sync = go(False, params)
    outs, stats, seen, ahead = go(True, params)
    assert outs == sync[0] and stats == sync[1] and 0 < stats.num_accepted_tokens
    for i in (0, 2, 3): json.loads(outs[i][2])                  # constrained: a complete document
    assert ahead.used >= 4 and ahead.dropped <= 1
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (30, 9, 25)]
    sync = go(False, params, simulate=2.5, late=None)
    outs, stats, seen, ahead = go(True, params, simulate=2.5, late=None)
    assert outs == sync[0] and stats == sync[1] and seen == sync[2] and stats.simulated == 2.5
    assert ahead.used >= 8 and ahead.dropped == 0
