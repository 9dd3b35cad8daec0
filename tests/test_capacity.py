"""Capacity-aware verification: the policies against brute force and the exact appendix-A law, losslessness
of the engine with every policy on (greedy identity with compact verification, sampled distribution), the
knee's exact fixed-K bypass, calibration bookkeeping, bad input, metrics and the CPU run of the GPU sweep."""
import itertools
import json

import pytest
import torch

import dspark
from dspark.spec.capacity import (LaggedBudget, SPSCurve, admit_top, batch_survival, eager_verify_fit,
                             first_token_law, global_lengths, scheduler_lengths, search_budget, threshold_lengths)
from dspark.spec.device_policy import DeviceAllocator
from dspark.spec.controller import CapacityConfig
from dspark.tools.capacity_sweep import capacity_sweep
from dspark.entrypoints.llm import LLM
from dspark.engine.metrics import EngineMetrics, scrape
from dspark.sample.sampling import SamplingParams

KV = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
# verification gets dearer with every token: the policies keep some drafts and drop others
STEEP = [(B, 1.0 / (1.0 + 0.08 * B)) for B in range(1, 65)]


@pytest.fixture(scope="module")
def ck7(tmp_path_factory):
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("cap7"), seed=3, drafter="dspark", dspark_block_size=7)


def _prompts(n, seed, lo=4, hi=60):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- policies

def test_appendix_a_exact():
    "SPS = (1, .5, .45), p = (.7, .3), q = (.5, .5), a1 = .8: the early break gives p, the unconstrained search (.85, .15)."
    p, q = torch.tensor([0.7, 0.3], dtype=torch.float64), torch.tensor([0.5, 0.5], dtype=torch.float64)
    sps = SPSCurve.from_sps([(1, 1.0), (2, 0.5), (3, 0.45)]).for_requests(1)
    conf = lambda xs: [0.8, 0.9 if xs[0] == 0 else 0.1]          # c2 depends on x1, as through the Markov embedding
    exact = lambda policy: first_token_law(p, q, conf, policy, K=2)
    torch.testing.assert_close(exact(lambda a: scheduler_lengths(a, sps)[0]), p, rtol=0, atol=1e-12)
    torch.testing.assert_close(exact(lambda a: global_lengths(a, sps)[0]), torch.tensor([0.85, 0.15], dtype=torch.float64),
                               rtol=0, atol=1e-12)


def _random_survival(g, R, K):
    c = torch.rand(R, K, generator=g, dtype=torch.float64)
    n = torch.randint(0, K + 1, (R,), generator=g)
    return batch_survival(torch.logit(c), n)


def _brute(a, sps):
    "Θ of every allocation of prefix lengths (ℓ_r ≤ drafts of r): {lengths: Θ}."
    R, n = a.shape[0], (a > 0).sum(-1).tolist()
    out = {}
    for ls in itertools.product(*[range(m + 1) for m in n]):
        tau = R + sum(float(a[r, :l].sum()) for r, l in enumerate(ls))
        out[ls] = tau * sps(R + sum(ls))
    return out


def _theta(a, ls, sps):
    return (a.shape[0] + sum(float(a[r, :l].sum()) for r, l in enumerate(ls))) * sps(a.shape[0] + sum(ls))


@pytest.mark.parametrize("seed", range(12))
def test_algorithm1_against_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    R, K = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    a = _random_survival(g, R, K)
    beta = float(torch.rand(1, generator=g)) * 0.6
    logconcave = lambda B: float(torch.exp(torch.tensor(-beta * B)))   # Θ is then unimodal along the ranked order
    jagged = dict(enumerate(torch.rand(R * (K + 1) + 2, generator=g).tolist() + [0.1])).get
    for sps in (logconcave, jagged):
        brute = _brute(a, sps)
        best = max(brute.values())
        # the unconstrained search finds the global optimum over all prefix-closed allocations
        assert abs(_theta(a, global_lengths(a, sps), sps) - best) < 1e-9
        assert sum(global_lengths(a, sps)) == search_budget(a, sps)
        ls = scheduler_lengths(a, sps)
        assert all(l <= int((row > 0).sum()) for l, row in zip(ls, a))
        assert _theta(a, ls, sps) <= best + 1e-12
        # every admitted candidate strictly improved Θ, and the next one in survival order would not have
        ranked = sorted(((float(a[r, j]), r, j) for r in range(R) for j in range(K) if a[r, j] > 0),
                        key=lambda t: -t[0])
        n, cur = 0, [0] * R
        for _, r, j in ranked:
            nxt = cur.copy(); nxt[r] = j + 1
            if _theta(a, nxt, sps) > _theta(a, cur, sps): cur, n = nxt, n + 1
            else: break
        assert ls == cur
    assert abs(_theta(a, scheduler_lengths(a, logconcave), logconcave) - max(_brute(a, logconcave).values())) < 1e-9


def test_survival_and_threshold():
    z = torch.tensor([[2.0, 0.0, -1.0], [1.0, 1.0, 1.0]])
    a = batch_survival(z, [3, 2])
    c = torch.sigmoid(z.double())
    torch.testing.assert_close(a[0], c[0].cumprod(0))
    torch.testing.assert_close(a[1], torch.tensor([c[1, 0], c[1, 0] * c[1, 1], 0.0], dtype=torch.float64))
    assert threshold_lengths(a, 0.0) == [3, 2] and threshold_lengths(a, 1.0) == [0, 0]
    assert threshold_lengths(a, 0.5) == [1, 2]                            # rows 0.881 0.440 0.129 | 0.731 0.534
    assert admit_top(a, 2) == [1, 1] and admit_top(a, 3) == [1, 2] and admit_top(a, 4) == [2, 2]


@pytest.mark.parametrize("policy", ["threshold", "scheduler", "lagged"])
def test_device_policy_equals_the_host_policy(policy):
    """`DeviceAllocator` (the policies as fixed-shape tensor work behind the draft step) gives the host policies'
    lengths, the search's budget and the candidate count exactly, for random batches, depths, calibrations, timings
    and lagged decisions; rows past R and positions past the depth are never candidates."""
    g = torch.Generator().manual_seed(7)
    curve = SPSCurve([(B, 0.8 + 0.02 * B) for B in (1, 2, 4, 8, 16, 32, 48)], draft_ms=0.03, capture_limit=32, draft_step_ms=0.3)
    alloc = DeviceAllocator(5, 8, curve, policy, 0.4, "cpu")
    for trial in range(40):
        R, depth = int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        z = torch.randn(8, 5, generator=g) * 2.5               # rows past R: stale buffer contents
        temps = torch.rand(5, generator=g, dtype=torch.float64) * 2 + 0.25
        lagged = None if trial % 4 == 0 else (int(torch.randint(0, 5 * R + 1, (1,), generator=g)), int(torch.randint(1, 9, (1,), generator=g)))
        host_ms = 0.02 * (trial % 5)
        alloc.prepare(host_ms, curve.draft_step_ms, curve.draft_ms, lagged, temps, depth)
        got, dec = alloc.launch(z, R)()
        a = batch_survival(z[:R].double() / temps, [depth] * R)
        sps = curve.for_requests(R, host_ms * R)
        if policy == "threshold": want = threshold_lengths(a, 0.4)
        elif policy == "scheduler": want = scheduler_lengths(a, sps)
        else:
            lb = LaggedBudget()
            lb.history = [] if lagged is None else [lagged, (1, 1)]
            want = lb.lengths(a, lambda _: sps)
            assert lb.history[-1] == (dec.budget, R)
        assert got == want and all(k <= depth for k in got)
        assert (dec.budget, dec.candidates, dec.requests) == (search_budget(a, sps), int((a > 0).sum()), R)
    with pytest.raises(ValueError, match="requests"): alloc.launch(torch.zeros(9, 5), 9)
    with pytest.raises(ValueError, match="the device decides"): DeviceAllocator(5, 8, curve, "auto", 0.4, "cpu")


def test_device_policy_in_the_engine(ck7, greedy_ref):
    """With the confidences read, the engine takes each step's lengths from the device decision queued behind its
    draft step; with a policy that reads neither timings nor calibration (a threshold, STS off) it cuts exactly the
    drafts the host policy cuts, and the output is greedy decoding's."""
    prompts, sp, ref = greedy_ref
    runs = {}
    for dev in (True, False):
        cap = CapacityConfig(policy="threshold", threshold=0.3, sps=STEEP, activation=1, online_sts=False, device_policy=dev)
        llm = LLM(ck7, speculative="dspark", num_speculative_tokens=5, capacity=cap, **KV)
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == ref
        st = llm.runner.capacity.stats
        runs[dev] = (st.kept, st.proposed, list(st.kept_hist), llm.spec_stats())
        assert (llm.runner.proposer.allocator is not None) == dev
        assert st.active_steps == st.device_decisions + st.host_decisions
        assert (st.device_decisions > st.host_decisions) if dev else st.device_decisions == 0
    assert runs[True] == runs[False] and 0 < runs[True][0] < runs[True][1]
    with pytest.raises(ValueError, match="device_policy"): CapacityConfig(device_policy=1)


# ---------------------------------------------------------------- engine: losslessness

@pytest.fixture(scope="module")
def greedy_ref(ck7):
    prompts = _prompts(4, seed=1)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    return prompts, sp, _ids(LLM(ck7, **KV).generate(prompts, sp, use_tqdm=False))


@pytest.mark.parametrize("K,policy", [(2, "scheduler"), (5, "lagged"), (7, "threshold")])
def test_greedy_identity_compact(ck7, greedy_ref, K, policy):
    "Compact verification (pruned drafts never reach the target) is token-identical to greedy decoding."
    prompts, sp, ref = greedy_ref
    cap = CapacityConfig(policy=policy, sps=STEEP, activation=1, threshold=0.3, depth_window=2)
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=K, capacity=cap, **KV)
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == ref
    st = spec.runner.capacity.stats
    assert st.active_steps > 0 and 0 < st.kept < st.proposed        # drafts were really cut, and some were verified
    assert spec.spec_stats()["num_draft_tokens"] == st.kept         # the target saw exactly the kept drafts


def test_sampled_distribution_with_capacity(tmp_path):
    """T = 1 on a 16-token vocabulary with every mechanism on (Algorithm 1 on a steep curve, dynamic depth,
    online STS): the first two generated tokens follow the target's exact distribution."""
    ck = dspark.make_tiny_checkpoint(tmp_path / "v16", seed=5, drafter="dspark", vocab_size=16, dspark_block_size=3)
    target = dspark.load_target(ck)
    prompt = [0, 5, 9, 3]
    p1 = target.logits(torch.tensor([prompt]))[0, -1].softmax(-1).double()
    p2 = torch.stack([target.logits(torch.tensor([prompt + [x]]))[0, -1].softmax(-1) for x in range(16)]).double()
    cap = CapacityConfig(policy="scheduler", sps=[(B, 1.0 / (1.0 + 0.02 * B)) for B in range(1, 300)], activation=1,
                         depth_window=1)
    spec = LLM(ck, speculative="dspark", num_speculative_tokens=3, max_num_seqs=64, max_num_batched_tokens=1024,
               kv_cache_memory_bytes=64 * 2**20, capacity=cap)
    N = 400
    outs = spec.generate([prompt] * N, [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True) for s in range(N)],
                         use_tqdm=False)
    x = torch.tensor([o.outputs[0].token_ids[:2] for o in outs])
    cs = spec.runner.capacity.stats
    assert spec.spec_stats()["num_accepted_tokens"] > 25 and 0 < cs.kept < cs.proposed
    assert cs.kept_hist[0] > 0 and sum(cs.kept_hist[1:]) > 0        # some requests verify drafts, some none
    for col, exact in ((0, p1), (1, p1 @ p2)):
        counts = torch.bincount(x[:, col], minlength=16).double()
        keep = exact * N >= 5
        obs = torch.cat([counts[keep], counts[~keep].sum(0, keepdim=True)])
        exp = torch.cat([exact[keep], exact[~keep].sum(0, keepdim=True)]) * N
        chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum())
        p_value = float(torch.special.gammaincc(torch.tensor(int(keep.sum()) / 2.0), torch.tensor(chi2 / 2.0)))
        assert p_value > 1e-3, (col, chi2)


def test_knee_bypass_is_exactly_fixed_k(ck7):
    "Below the knee nothing is read or cut: sampled tokens and every spec counter equal the fixed-K engine's."
    prompts = _prompts(3, seed=4)
    sp = [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True) for s in range(3)]
    fixed = LLM(ck7, speculative="dspark", num_speculative_tokens=4, **KV)
    ref = _ids(fixed.generate(prompts, sp, use_tqdm=False))
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=4, capacity=CapacityConfig(sps=STEEP, activation=4), **KV)
    assert _ids(spec.generate(prompts, sp, use_tqdm=False)) == ref                # 3 requests < 4: bypassed
    assert spec.spec_stats() == fixed.spec_stats()
    cs = spec.runner.capacity.stats
    assert cs.active_steps == 0 and cs.bypassed_steps > 0 and spec.runner.capacity.depth == 4
    assert not spec.runner.capacity.staged and float(spec.runner.capacity.sts.trials.sum()) == 0
    assert spec.runner.proposer.confidence is None                 # and no confidences were read back
    # the automatic knee: on a flat curve verifying everything is free at any load, so it never activates
    flat = LLM(ck7, speculative="dspark", num_speculative_tokens=4, capacity=CapacityConfig(sps=[(B, 1.0) for B in range(1, 32)]), **KV)
    assert flat.runner.capacity.activation == KV["max_num_seqs"] + 1
    assert LLM(ck7, speculative="dspark", num_speculative_tokens=4, capacity=CapacityConfig(sps=STEEP), **KV).runner.capacity.activation == 2


def test_calibration_records_only_controlled_aligned_rounds(ck7):
    prompts = _prompts(2, seed=6)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=5, capacity=CapacityConfig(sps=STEEP, activation=1), **KV)
    spec.generate(prompts, sp, use_tqdm=False)
    sts, st = spec.runner.capacity.sts, spec.spec_stats()
    assert 0 < float(sts.trials.sum()) and not spec.runner.capacity.staged   # finished requests leave nothing staged
    # a proposal whose draft window is not in the ring (nothing observed) is flagged incomplete
    pr, m = spec.runner.proposer, spec.runner.proposer.drafter.mtp[0].main_proj.in_features
    pr.ctx.claim(3, "fresh"); pr.ctx.insert(3, torch.zeros(2, m), torch.tensor([5, 6]))
    pr.propose(3, "fresh", 9, 7, 3, sp, 0)                           # the anchor at P = 7: positions 0-4 missing
    assert pr.confidence["fresh"][1] is False
    pr.ctx.insert(3, torch.zeros(7, m), torch.arange(7))
    pr.propose(3, "fresh", 9, 7, 3, sp, 0)
    assert pr.confidence["fresh"][1] is True
    # a shallower physical depth runs fewer Markov steps and drafts the same prefix (noise keyed by position)
    t1 = SamplingParams(temperature=1.0)
    (full, qf), (short, qs) = pr.propose(3, "fresh", 9, 7, 6, t1, 4), pr.propose(3, "fresh", 9, 7, 2, t1, 4)
    assert short == full[:2] and torch.equal(qs, qf[:2]) and len(pr.confidence["fresh"][0]) == 2


# ---------------------------------------------------------------- configuration, files, metrics, sweep

def test_bad_input(ck7, tmp_path):
    for kw, match in [(dict(policy="greedy"), "policy"), (dict(threshold=-0.1), "threshold"), (dict(threshold=1.5), "threshold"),
                      (dict(activation=0), "activation"), (dict(depth_window=0), "depth_window"),
                      (dict(sps=str(tmp_path / "missing.json")), "sps")]:
        with pytest.raises(ValueError, match=match): CapacityConfig(**kw)
    with pytest.raises(TypeError, match="capacity"): LLM(ck7, speculative="dspark", capacity=3)
    with pytest.raises(ValueError, match="DSpark confidence"): LLM(ck7, capacity="scheduler")
    bad = {"notjson.json": "{", "empty.json": "[]", "order.json": json.dumps([[4, 1.0], [2, 1.0]]),
           "neg.json": json.dumps({"sps": [[1, -1.0]]}), "keys.json": json.dumps({"verify_ms": [[1, 1.0]], "gpu": 1}),
           "shape.json": json.dumps({"points": 1}), "frac.json": json.dumps({"verify_ms": [[1.5, 1.0]]})}
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match="SPS curve file"): SPSCurve.load(tmp_path / name)
    with pytest.raises(ValueError, match="does not exist"): SPSCurve.load(tmp_path / "nope.json")
    c = SPSCurve([(1, 2.0), (8, 4.0)], 0.5, 8)
    c.save(tmp_path / "ok.json")
    assert SPSCurve.load(tmp_path / "ok.json") == c


def test_eager_verify_fit():
    "The eager profile's split: per-request cost is not priced as tokens, and the line recovers a known cost model."
    t = lambda r, m: 4.0 + 3.0 * r + 0.25 * r * m              # base, per request, per token (ms)
    R, K = 16, 5
    pts, per_request = eager_verify_fit(t(1, 1), t(R, 1), t(R, K + 1), R, K)
    assert per_request == pytest.approx(3.0)
    curve = SPSCurve(pts, per_request, 0)
    for r, m in ((16, 1), (16, 6), (7, 3), (30, 6)):             # every batch, inside the profile or past it
        assert curve.draft_ms * r + curve.verify(r * m) == pytest.approx(t(r, m))
    flat = eager_verify_fit(10.0, 40.0, 39.0, R, K)[0]          # noise: deep below wide reads as free tokens, not negative
    assert flat[0][1] == flat[1][1] > 0
    assert eager_verify_fit(5.0, 5.0, 5.0, 1, K) == ([(1, 5.0), (K + 1, 5.0)], 0.0)


def test_auto_profile_and_metrics(ck7):
    "sps='auto' measures the curve on a scratch cache; the engine's capacity counters reach /metrics."
    spec = LLM(ck7, speculative="dspark", num_speculative_tokens=1, max_num_seqs=1, max_num_batched_tokens=64,
               kv_cache_memory_bytes=16 * 2**20, capacity=CapacityConfig(activation=1))
    curve = spec.runner.capacity.curve
    # eager: one line through B = 1 and a full batch of K + 1 tokens a request, no buckets, the batched draft step timed
    assert [B for B, _ in curve.verify_ms] == [1, 2] and curve.capture_limit == 0 and curve.draft_step_ms > 0
    assert all(ms > 0 for _, ms in curve.verify_ms) and curve.verify_ms[1][1] >= curve.verify_ms[0][1]
    spec.generate(_prompts(1, seed=8), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    m = EngineMetrics("tiny")
    m.observe_engine(spec)
    got, cs = scrape(m.render().decode()), spec.runner.capacity.stats
    assert got["dspark:capacity_active"] == 1 and got["dspark:draft_depth"] == spec.runner.capacity.depth
    assert got["dspark:capacity_proposed_drafts_total"] == cs.proposed and got["dspark:capacity_kept_drafts_total"] == cs.kept
    assert sum(v for k, v in got.items() if k.startswith("dspark:capacity_requests_by_kept_drafts_total")) == cs.active_steps
    assert got["dspark:capacity_graph_tokens"] == 0                 # eager steps pad to no graph


def test_serve_flags(ck7):
    from dspark.entrypoints.serve import capacity_config, parse_args, resolve
    a = parse_args(["--model", str(ck7), "--kv-cache-memory-bytes", str(64 * 2**20)],
                   env={"DSPARK_CAPACITY": "lagged", "DSPARK_CAPACITY_ACTIVATION": "2", "DSPARK_ONLINE_STS": "0"})
    conf, _ = resolve(a)
    assert conf["capacity"]["policy"] == "lagged" and conf["capacity"]["activation"] == 2 and not conf["capacity"]["online_sts"]
    assert not conf["capacity"]["plain_switch"]                       # opt-in
    a = parse_args(["--model", str(ck7), "--capacity", "auto", "--plain-switch"], env={})
    assert capacity_config(a).plain_switch
    with pytest.raises(SystemExit): parse_args(["--capacity-threshold", "2", "--capacity", "threshold"], env={})
    a = parse_args(["--model", str(ck7), "--kv-cache-memory-bytes", str(64 * 2**20), "--capacity", "off"], env={})
    assert resolve(a)[0]["capacity"] is None and capacity_config(a) is None


def test_capacity_sweep_runs_on_cpu(ck7):
    rows = capacity_sweep(ck7, concurrencies=(1, 2), device="cpu", num_speculative_tokens=3, max_tokens=4, prompt_len=16,
                          capacity=CapacityConfig(sps=STEEP, activation=2))
    assert [(r["mode"], r["concurrency"]) for r in rows] == [(m, c) for m in ("none", "fixed", "capacity") for c in (1, 2)]
    assert all(r["tokens"] == 4 * r["concurrency"] and r["tok_s"] > 0 for r in rows)
    by = {(r["mode"], r["concurrency"]): r for r in rows}
    assert by["none", 2]["drafts"] == 0 and by["fixed", 2]["drafts"] > 0 and by["fixed", 2]["mean_acceptance_length"] >= 1
    assert by["capacity", 1]["active_steps"] == 0 and by["capacity", 2]["active_steps"] > 0   # knee at 2 requests


def test_capacity_sweep_steady_load(ck7):
    "`waves`: 3 × c requests at most c in flight; capacity control still activates once 2 are in flight."
    rows = capacity_sweep(ck7, concurrencies=(2,), device="cpu", num_speculative_tokens=3, max_tokens=4, prompt_len=16,
                          capacity=CapacityConfig(sps=STEEP, activation=2), modes=("fixed", "capacity"), repeats=1,
                          waves=3)
    assert [(r["mode"], r["requests"], r["tokens"]) for r in rows] == [("fixed", 6, 24), ("capacity", 6, 24)]
    assert rows[1]["active_steps"] > 0
    with pytest.raises(ValueError, match="waves"): capacity_sweep(ck7, device="cpu", waves=0)


def test_measured_host_time_gates_activation():
    "With the automatic knee, a load where host time swamps verification stays bypassed (exactly fixed K)."
    from types import SimpleNamespace
    from dspark.spec.capacity import SPSCurve
    from dspark.spec.controller import CapacityController
    curve = SPSCurve([(1, 1.0), (8, 1.0), (16, 2.0), (48, 6.0), (96, 12.0)], capture_limit=96)   # verify is costly
    cap = CapacityController(CapacityConfig(policy="scheduler"), 5, curve, [1, 8, 16, 48, 96], 16)
    assert cap.activation <= 8 and cap.worth(8)                  # no host time measured: pruning pays at 8
    cap.host_ms_per_request = 10.0                               # 80 ms of host time a step at 8 requests
    assert not cap.worth(8)
    runner = SimpleNamespace(proposer=SimpleNamespace(confidence={}), q={}, canon=lambda d, *a: d)
    reqs = [SimpleNamespace(request_id=str(i), drafts=[1, 2, 3, 4, 5]) for i in range(8)]
    for i in range(8): runner.proposer.confidence[str(i)] = (torch.full((5,), -3.0), True)   # unsure drafts
    cap.apply(reqs, runner)
    assert cap.stats.bypassed_steps == 1 and all(len(r.drafts) == 5 for r in reqs)
    assert runner.proposer.confidence is None                    # bypassed: the next proposals are not read back
    cap.host_ms_per_request = 0.0
    reqs = [SimpleNamespace(request_id=str(i), drafts=[1, 2, 3, 4, 5]) for i in range(8)]
    cap.apply(reqs, runner)                                      # worth it now, but these drafts were proposed unread
    assert cap.stats.bypassed_steps == 2 and all(len(r.drafts) == 5 for r in reqs) and runner.proposer.confidence == {}
    reqs = [SimpleNamespace(request_id=str(i), drafts=[1, 2, 3, 4, 5]) for i in range(8)]
    for i in range(8): runner.proposer.confidence[str(i)] = (torch.full((5,), -3.0), True)
    cap.apply(reqs, runner)
    assert cap.stats.active_steps == 1 and sum(len(r.drafts) for r in reqs) < 40   # now it prunes


def test_steady_bypass_coasts_between_full_decisions():
    """Bypassed under a steady load, the controller decides on two steps of every `coast + 2` (the first marks the
    time, the second records it) and lets the others pass, counted as bypassed; a request count outside the bucket,
    an idle engine and `coast=0` end it, and the drafts are never cut."""
    from types import SimpleNamespace
    from dspark.spec.capacity import SPSCurve
    from dspark.spec.controller import CapacityController
    flat = SPSCurve([(1, 1.0), (96, 1.0)], capture_limit=96)             # pruning never pays: always bypassed
    def full_decisions(steps: int, coast: int) -> int:   # the schedule the docstring states
        full, left, marked = 0, 0, False
        for _ in range(steps):
            if left: left -= 1; continue
            full += 1
            if marked and coast: left, marked = coast, False
            else: marked = True
        return full
    assert full_decisions(40, 14) == 6 and full_decisions(40, 0) == 40
    for coast in (14, 3, 0):
        cap = CapacityController(CapacityConfig(policy="scheduler", coast=coast, plain_switch=False), 5, flat, [1, 8, 96], 16)
        cap.activation = 2
        calls = []
        time0 = cap._time_step
        cap._time_step = lambda R, B: (calls.append(R), time0(R, B))
        st = SimpleNamespace(num_drafts=0, num_accepted_tokens=0)
        runner = SimpleNamespace(proposer=SimpleNamespace(confidence=None), canon=lambda d, *a: d, stats=st)
        reqs = lambda n: [SimpleNamespace(request_id=str(i), drafts=[1, 2, 3]) for i in range(n)]
        for _ in range(40):
            st.num_drafts += 8; st.num_accepted_tokens += 12
            batch = reqs(8)
            cap.apply(batch, runner)
            assert all(len(r.drafts) == 3 for r in batch)
        s = cap.stats
        assert s.bypassed_steps == 40 and s.active_steps == 0
        assert len(calls) == full_decisions(40, coast)
        assert s.coasted_steps == 40 - len(calls)
        assert cap.bypasses(8) and cap.bypasses(6)                       # the gates: the next step is bypassed
        cap.apply(reqs(7), runner)                                       # a request finished: the same bucket (5-8),
        assert len(calls) == full_decisions(41, coast)                   # the schedule goes on
        before = len(calls)
        cap.apply(reqs(4), runner)                                       # four finished: another bucket, a decision
        assert len(calls) == before + 1
        cap.idle(); cap.apply(reqs(7), runner)
        assert len(calls) == before + 2 and cap._coast is None           # after idling, the first step only marks
    cap = CapacityController(CapacityConfig(policy="scheduler", plain_switch=True), 5, flat, [1, 8, 96], 16)   # with the switch:
    cap.activation, cap.switch.decide = 2, lambda R: True                # drafting is off, no coasting
    for _ in range(5): cap.apply(reqs(8), runner)
    assert cap.stats.coasted_steps == 0
    with pytest.raises(ValueError, match="coast must be"): CapacityConfig(coast=-1)


def test_fused_round_is_kept_when_pruning_saves_less_than_its_overlap():
    "Lagged control under fused rounds: a pruned batch that would verify no cheaper than the round keeps every draft."
    from types import SimpleNamespace
    from dspark.spec.capacity import SPSCurve
    from dspark.spec.controller import CapacityController
    sizes = [8, 16, 32, 48]
    rounds = SimpleNamespace(graphs={8: None}, rows=lambda R: 8 * 6 if R <= 8 else None)   # one 8-request round, width 6
    greedy = SamplingParams(temperature=0.0)
    def run(curve, host):
        cap = CapacityController(CapacityConfig(policy="lagged", activation=2, dynamic_depth=False, online_sts=False),
                                 5, curve, sizes, 8)
        cap.host_ms_per_request = host
        runner = SimpleNamespace(proposer=SimpleNamespace(confidence={}), canon=lambda d, *a: d,
                                 forward=SimpleNamespace(rounds=rounds))
        for step in range(4):                                    # the lagged budget needs two decisions of history
            reqs = [SimpleNamespace(request_id=str(i), drafts=[1, 2, 3, 4, 5], params=greedy) for i in range(8)]
            for i in range(8): runner.proposer.confidence[str(i)] = (torch.tensor([3.0, 3.0, -4.0, -4.0, -4.0]), True)
            cap.apply(reqs, runner)
        return sum(len(r.drafts) for r in reqs), cap
    flat = SPSCurve([(8, 1.0), (16, 1.02), (32, 1.05), (48, 1.1)], capture_limit=48, draft_step_ms=0.5)
    kept, cap = run(flat, host=0.1)                              # the round's 48 rows cost 0.08 ms more than 32: < overlap
    assert kept == 40 and cap._round_tokens([SimpleNamespace(params=greedy)] * 8, SimpleNamespace(forward=SimpleNamespace(rounds=rounds))) == 48
    steep = SPSCurve([(8, 1.0), (16, 2.0), (32, 4.0), (48, 6.0)], capture_limit=48, draft_step_ms=0.5)
    kept, _ = run(steep, host=0.1)                               # verify dominates: pruning leaves the round and pays
    assert kept < 40
    assert not CapacityController(CapacityConfig(), 5, flat, sizes, 8).worth(8, round_tokens=48)
    assert CapacityController(CapacityConfig(), 5, steep, sizes, 8).worth(8, round_tokens=48)
