"""Where capacity control's time goes against fixed K under a steady load, on the engine capacity_sweep builds (the
trained default model, bf16, graphs): `WAVES x C` requests, at most C in flight, fixed K and capacity alternating for
`REPEATS` runs. Per mode: tok/s, steps by kind (rounds launched ahead and taken, plain steps, admitting steps), the
host's time per step, and a cProfile of the engine's steps (top functions by own time).
OUT=. [C=64] [WAVES=4] [REPEATS=3] [TOKENS=128] [TOP=22] python capacity_host_profile.py"""
import collections, cProfile, io, json, os, pstats, statistics, time, torch
from dspark.tools.capacity_sweep import capacity_attached, sweep_run
from dspark.engine.core import frozen_heap
from steady_engine import steady_engine

OUT = os.environ["OUT"]
C, WAVES, REPEATS, TOKENS, prompts, llm = steady_engine(3)
steps = collections.defaultdict(list)
step0 = llm.step
def step():
    t = time.perf_counter(); out = step0(); steps[mode].append(time.perf_counter() - t); return out
llm.step = step
profs = {m: cProfile.Profile() for m in ("fixed", "capacity")}
runs = collections.defaultdict(list)
ra = llm.runner.round_ahead
for rep in range(REPEATS):
    for mode in (("fixed", "capacity") if rep % 2 == 0 else ("capacity", "fixed")):
        used0, dropped0 = (ra.used, ra.dropped) if ra else (0, 0)
        with capacity_attached(llm, mode == "capacity"), frozen_heap():
            profs[mode].enable()
            r = sweep_run(llm, mode, C, prompts, 0.0, TOKENS, 0, torch.cuda.synchronize, WAVES)
            profs[mode].disable()
        r["rounds_ahead_used"], r["rounds_ahead_dropped"] = (ra.used - used0, ra.dropped - dropped0) if ra else (0, 0)
        runs[mode].append({k: v for k, v in r.items() if k != "switch_rates"})
        print(mode, json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in runs[mode][-1].items()}), flush=True)
res = {"gpu": torch.cuda.get_device_name(), "C": C, "waves": WAVES, "runs": runs,
       "tok_s_median": {m: round(statistics.median(r["tok_s"] for r in v), 1) for m, v in runs.items()},
       "step_ms": {m: {"steps": len(v), "median": round(1e3 * statistics.median(v), 3), "mean": round(1e3 * statistics.mean(v), 3),
                       "p90": round(1e3 * sorted(v)[int(0.9 * len(v))], 3)} for m, v in steps.items()}}
res["capacity_over_fixed"] = round(res["tok_s_median"]["capacity"] / res["tok_s_median"]["fixed"], 4)
print(json.dumps({k: res[k] for k in ("tok_s_median", "step_ms", "capacity_over_fixed")}), flush=True)
for m, p in profs.items():
    s = io.StringIO(); pstats.Stats(p, stream=s).sort_stats("tottime").print_stats(int(os.environ.get("TOP", 22)))
    res[f"cprofile_{m}"] = s.getvalue()
    print(m, s.getvalue()[:9000], flush=True)
json.dump(res, open(f"{OUT}/{os.environ.get('NAME', 'capacity_host_profile')}.json", "w"), indent=1)
