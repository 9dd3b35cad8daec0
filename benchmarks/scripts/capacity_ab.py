"""Where capacity control's 3-4% under fixed K at 64 requests goes (chapter 21): one DSpark engine under a steady load
(`WAVES x C` requests, at most C in flight, 128-token held-out prompts), four arms taking turns in a rotating order —
fixed K, fixed K again (an A/A control: what the order and the machine alone give), capacity control as shipped, and
capacity control with its plain switch detached. Per run: tok/s, engine steps, rounds launched ahead (behind a round
and behind a draft step) and dropped, plain steps, and the host time spent inside the controller.
OUT=. [C=64] [WAVES=4] [REPEATS=8] [TOKENS=128] [NAME=capacity_ab] python capacity_ab.py"""
import collections, json, os, statistics, time, torch
from dspark.tools.capacity_sweep import capacity_attached, sweep_run
from dspark.engine.core import frozen_heap
from steady_engine import steady_engine

OUT = os.environ["OUT"]
C, WAVES, REPEATS, TOKENS, prompts, llm = steady_engine(8)
cap, ra, da = llm.runner.capacity, llm.runner.round_ahead, llm.runner.ahead
inside, depth = collections.Counter(), [0]
for name in ("apply", "bypasses", "_switch", "_time_step", "_round_tokens"):
    fn = getattr(cap, name)
    def wrap(*a, _fn=fn, _n=name, **k):      # time spent in `apply`, and in its parts; `bypasses` outside it (the gates)
        key = _n if _n == "apply" or depth[0] == 0 else f"apply:{_n}"
        depth[0] += _n == "apply"
        t = time.perf_counter()
        try: return _fn(*a, **k)
        finally:
            inside[key] += time.perf_counter() - t; depth[0] -= _n == "apply"
    setattr(cap, name, wrap)
nsteps = [0]
step0 = llm.step
def step():
    nsteps[0] += 1; return step0()
llm.step = step
switch = cap.switch
ARMS = ("fixed", "fixed_b", "capacity", "capacity_noswitch")
runs = collections.defaultdict(list)
for rep in range(REPEATS + 1):                      # rep 0 learns the switch's rates and warms every arm: not kept
    order = ARMS[rep % 4:] + ARMS[:rep % 4]
    for arm in order:
        cap.switch = None if arm == "capacity_noswitch" else switch
        c0 = (ra.used, ra.dropped, ra.first, da.used if da else 0, da.dropped if da else 0, nsteps[0])
        inside.clear()
        with capacity_attached(llm, arm.startswith("capacity")), frozen_heap():
            r = sweep_run(llm, arm, C, prompts, 0.0, TOKENS, 0, torch.cuda.synchronize, WAVES)
        c1 = (ra.used, ra.dropped, ra.first, da.used if da else 0, da.dropped if da else 0, nsteps[0])
        r.update(dict(zip(("rounds_ahead_used", "rounds_ahead_dropped", "first_rounds", "decode_ahead_used",
                           "decode_ahead_dropped", "steps"), (b - a for a, b in zip(c0, c1)))),
                 rep=rep, position=order.index(arm),
                 controller_ms=round(1e3 * sum(v for k, v in inside.items() if not k.startswith("apply:")), 2),
                 controller_parts_ms={k: round(1e3 * v, 2) for k, v in inside.items()})
        r.pop("switch_rates", None)
        if rep: runs[arm].append(r)
        print(arm, rep, round(r["tok_s"], 1), {k: r[k] for k in ("steps", "rounds_ahead_used", "first_rounds",
              "rounds_ahead_dropped", "plain_steps", "bypassed_steps", "active_steps", "controller_ms", "controller_parts_ms")}, flush=True)
cap.switch = switch
res = {"gpu": torch.cuda.get_device_name(), "C": C, "waves": WAVES, "tokens": TOKENS, "runs": runs, "paired": {}}
for arm in ARMS[1:]:
    ratios = sorted(b["tok_s"] / a["tok_s"] for a, b in zip(runs["fixed"], runs[arm]))
    res["paired"][f"{arm}_over_fixed"] = {"median": round(statistics.median(ratios), 4),
                                         "range": [round(ratios[0], 4), round(ratios[-1], 4)]}
res["tok_s_median"] = {a: round(statistics.median(r["tok_s"] for r in v), 1) for a, v in runs.items()}
print(json.dumps({k: res[k] for k in ("paired", "tok_s_median")}), flush=True)
json.dump(res, open(f"{OUT}/{os.environ.get('NAME', 'capacity_ab')}.json", "w"), indent=1)
