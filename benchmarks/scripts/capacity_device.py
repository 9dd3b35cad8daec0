"""Capacity control forced on at 64 requests, its policy decided on the device behind each draft step
(`DeviceAllocator`, one captured graph per request bucket) or on the host (chapter 21). First a check on the GPU: the
captured allocator against the host policies on random batches (exact). Then one DSpark engine (default model, bf16,
graphs) with `activation=2` under a steady load (`WAVES x C`, at most C in flight, 128-token held-out prompts, TOKENS
each); three arms taking turns in a rotating order: fixed K (controller detached), capacity with the device policy,
capacity with the host policy. Per run: tok/s, decisions by side, kept/proposed drafts, host time inside `apply`.
OUT=. [C=64] [WAVES=4] [REPEATS=5] [TOKENS=128] [NAME=capacity_device] python capacity_device.py"""
import collections, json, os, statistics, time, torch, dspark
from dspark.spec.capacity import LaggedBudget, SPSCurve, batch_survival, scheduler_lengths, search_budget, threshold_lengths
from dspark.spec.device_policy import DeviceAllocator
from dspark.spec.controller import CapacityConfig
from dspark.tools.capacity_sweep import capacity_attached, sweep_run, sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.engine.core import frozen_heap

OUT, t0 = os.environ["OUT"], time.time()
C, WAVES, REPEATS, TOKENS = (int(os.environ.get(k, d)) for k, d in (("C", 64), ("WAVES", 4), ("REPEATS", 5), ("TOKENS", 128)))
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "C": C, "waves": WAVES, "tokens": TOKENS}

# 1. the captured allocator on the GPU against the host policies
g = torch.Generator().manual_seed(0)
curve = SPSCurve([(B, 0.5 + 0.002 * B) for B in (1, 2, 4, 8, 16, 32, 64, 128, 256, 384)], draft_ms=0.004, capture_limit=384, draft_step_ms=0.3)
checked = collections.Counter()
for policy in ("threshold", "scheduler", "lagged"):
    alloc = DeviceAllocator(5, 64, curve, policy, 0.4, "cuda")
    for trial in range(60):
        R, depth = int(torch.randint(1, 65, (1,), generator=g)), int(torch.randint(1, 6, (1,), generator=g))
        z = (torch.randn(64, 5, generator=g) * 2.5).cuda()
        temps = torch.rand(5, generator=g, dtype=torch.float64) * 2 + 0.25
        lagged = None if trial % 4 == 0 else (int(torch.randint(0, 5 * R + 1, (1,), generator=g)), int(torch.randint(1, 65, (1,), generator=g)))
        host_ms = 0.01 * (trial % 7)
        alloc.prepare(host_ms, curve.draft_step_ms, curve.draft_ms, lagged, temps, depth)
        got, dec = alloc.launch(z, R)()
        a = batch_survival(z[:R].cpu().double() / temps, [depth] * R)
        sps = curve.for_requests(R, host_ms * R)
        if policy == "threshold": want = threshold_lengths(a, 0.4)
        elif policy == "scheduler": want = scheduler_lengths(a, sps)
        else:
            lb = LaggedBudget(); lb.history = [] if lagged is None else [lagged, (1, 1)]
            want = lb.lengths(a, lambda _: sps)
        ok = got == want and (dec.budget, dec.candidates) == (search_budget(a, sps), int((a > 0).sum()))
        checked[f"{policy} {'equal' if ok else 'DIFFERENT'}"] += 1
    checked[f"{policy} graphs"] = len(alloc.graphs)
res["gpu_check"] = dict(checked)
print("gpu check", dict(checked), flush=True)

# 2. forced on at C under a steady load
prompts = sweep_prompts(DEFAULT_MODEL, C * WAVES, 128)
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=5, capacity=CapacityConfig(activation=2),
                 device="cuda", dtype="bfloat16", seed=0, max_num_seqs=C, max_num_batched_tokens=max(1024, C * 134),
                 max_model_len=128 + TOKENS + 7, enable_prefix_caching=False, kv_cache_memory_bytes=2 * 2**30)
llm.generate(prompts[:C], dspark.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
cap, pr = llm.runner.capacity, llm.runner.proposer
alloc = pr.allocator
res["policy"], res["curve"] = cap.config.policy, cap.curve.to_json()
spent = collections.Counter()
def timed(obj, name, key):
    fn = getattr(obj, name)
    def wrap(*a, **k):
        t = time.perf_counter()
        try: return fn(*a, **k)
        finally: spent[key] += time.perf_counter() - t
    setattr(obj, name, wrap)
timed(cap, "apply", "apply"); timed(cap, "observe_many", "observe"); timed(pr, "collect", "collect")
ra = llm.runner.round_ahead
ARMS = ("fixed", "device", "host")
runs = collections.defaultdict(list)
for rep in range(REPEATS + 1):                       # rep 0 warms every arm (and captures the allocator's graphs)
    order = ARMS[rep % 3:] + ARMS[:rep % 3]
    for arm in order:
        pr.allocator = alloc if arm == "device" else None
        s0 = (cap.stats.device_decisions, cap.stats.host_decisions)
        a0 = (ra.used, ra.dropped, ra.first) if ra is not None else (0, 0, 0)
        spent.clear()
        with capacity_attached(llm, arm != "fixed"), frozen_heap():
            r = sweep_run(llm, arm, C, prompts, 0.0, TOKENS, 0, torch.cuda.synchronize, WAVES)
        r.pop("switch_rates", None)
        r.update(device_decisions=cap.stats.device_decisions - s0[0], host_decisions=cap.stats.host_decisions - s0[1],
                 apply_ms=round(1e3 * spent["apply"], 2), observe_ms=round(1e3 * spent["observe"], 2),
                 collect_ms=round(1e3 * spent["collect"], 2), rep=rep,
                 **dict(zip(("rounds_ahead_used", "rounds_ahead_dropped", "first_rounds"),
                            (b - a for a, b in zip(a0, (ra.used, ra.dropped, ra.first) if ra is not None else (0, 0, 0))))))
        if rep: runs[arm].append(r)
        print(arm, rep, round(r["tok_s"], 1), {k: r[k] for k in ("active_steps", "bypassed_steps", "device_decisions",
              "host_decisions", "kept_drafts", "proposed_drafts", "apply_ms", "observe_ms", "collect_ms", "rounds_ahead_used",
              "rounds_ahead_dropped", "first_rounds", "mean_acceptance_length")}, flush=True)
pr.allocator = alloc
res["runs"] = runs
res["paired"] = {}
for arm in ARMS[1:]:
    q = sorted(b["tok_s"] / a["tok_s"] for a, b in zip(runs["fixed"], runs[arm]))
    res["paired"][f"{arm}_over_fixed"] = {"median": round(statistics.median(q), 4), "range": [round(q[0], 4), round(q[-1], 4)]}
q = sorted(b["tok_s"] / a["tok_s"] for a, b in zip(runs["host"], runs["device"]))
res["paired"]["device_over_host"] = {"median": round(statistics.median(q), 4), "range": [round(q[0], 4), round(q[-1], 4)]}
res["median"] = {arm: {k: statistics.median(r[k] for r in v) for k in ("tok_s", "apply_ms", "observe_ms", "collect_ms",
                 "kept_drafts", "proposed_drafts", "device_decisions", "host_decisions", "active_steps", "rounds_ahead_used",
                 "rounds_ahead_dropped")} for arm, v in runs.items()}
res["allocator_graphs"] = sorted(alloc.graphs)
res["wall_s"] = round(time.time() - t0, 1)
print(json.dumps({k: res[k] for k in ("paired", "median")}), flush=True)
json.dump(res, open(f"{OUT}/{os.environ.get('NAME', 'capacity_device')}.json", "w"), indent=1)
