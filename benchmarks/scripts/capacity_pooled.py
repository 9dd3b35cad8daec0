"""Capacity control against fixed K at one load, pooled over the records of builds whose controller bypasses there
(chapter 21): every paired repeat of the paired sweeps (`capacity_paired.py`: capacity ÷ fixed within a repeat) and
of the rotating A/A runs (`capacity_ab.py`: capacity ÷ fixed and, as the control, fixed K again ÷ fixed K within a
rotation). Reads the records with `load_record`; prints and writes the median and mean of each set of ratios with seeded bootstrap 95% intervals, so a
claim about "≥ fixed K" reads the spread that two identical arms show on the same machine. CPU only; reads JSON.
[OUT=DIR] [C=64] [NAME=capacity_pooled] python capacity_pooled.py [RECORD ...]"""
import json, os, random, statistics, sys
from pathlib import Path

from dspark.tools.records import load_record, write_record

SWEEPS = ["capacity_waves_bucket7", "capacity_waves_final5", "capacity_waves_device7", "capacity_waves_final9",
          "capacity_waves_all5", "capacity_waves_roomer15", "capacity_waves_eagerfit5"]
AB = ["capacity_ab_bucket", "capacity_ab_final", "capacity_ab_pooled"]

def sweep_pairs(rec: dict, c: int) -> list[float]:
    "Per-repeat capacity ÷ fixed at concurrency c from a paired-sweep record (runs listed in repeat order)."
    by = {(r["mode"], r["concurrency"]): r["tok_s_runs"] for r in rec["rows"]}
    if ("fixed", c) not in by: return []
    return [k / f for f, k in zip(by["fixed", c], by["capacity", c])]

def ab_pairs(rec: dict, arm: str) -> list[float]:
    "Per-rotation `arm` ÷ fixed from a rotating A/A record (runs kept in rotation order)."
    runs = rec["runs"]
    return [b["tok_s"] / a["tok_s"] for a, b in zip(runs["fixed"], runs.get(arm, []))]

def summary(xs: list[float], seed: int = 0, n: int = 10000) -> dict:
    "Median and mean with percentile-bootstrap 95% intervals (resampling the pairs, seeded)."
    if not xs: return {"pairs": 0}
    rng = random.Random(seed)
    meds, means = [], []
    for _ in range(n):
        s = rng.choices(xs, k=len(xs))
        meds.append(statistics.median(s)); means.append(statistics.fmean(s))
    meds.sort(); means.sort()
    ci = lambda v: [round(v[int(0.025 * n)], 4), round(v[int(0.975 * n) - 1], 4)]
    return {"pairs": len(xs), "median": round(statistics.median(xs), 4), "median_ci": ci(meds),
            "mean": round(statistics.fmean(xs), 4), "mean_ci": ci(means), "range": [round(min(xs), 4), round(max(xs), 4)]}

if __name__ == "__main__":
    C = int(os.environ.get("C", 64))
    names = [Path(a).stem for a in sys.argv[1:]] or SWEEPS + AB
    recs = {}
    for n in names:
        try: recs[n] = load_record(n)
        except FileNotFoundError: pass
    missing = [n for n in names if n not in recs]
    cap, aa, per = [], [], {}
    for n, rec in recs.items():
        rows = rec["rows"]
        if "rows" in rows: got, ctl = sweep_pairs(rows, C), []
        elif (rec["config"] or {}).get("C") == C: got, ctl = ab_pairs(rows, "capacity") + ab_pairs(rows, "capacity_noswitch"), ab_pairs(rows, "fixed_b")
        else: got, ctl = [], []
        cap += got; aa += ctl
        per[n] = {"capacity_over_fixed": summary(got), "fixed_again_over_fixed": summary(ctl)}
    res = {"records": list(recs), "missing": missing, "per_record": per,
           "capacity_over_fixed": summary(cap), "fixed_again_over_fixed": summary(aa)}
    for k in ("capacity_over_fixed", "fixed_again_over_fixed"): print(k, json.dumps(res[k]))
    if missing: print("missing records:", missing)
    write_record(os.environ.get("NAME", "capacity_pooled"), res, command="python benchmarks/scripts/capacity_pooled.py",
                 config={"concurrency": C}, folder=os.environ.get("OUT"))
