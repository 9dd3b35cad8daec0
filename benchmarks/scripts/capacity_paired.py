"""Capacity control against fixed K and no speculation on the trained default model (bf16, CUDA graphs, H200): the
chapter-21 sweep with 7 repeats of 256 tokens per request, modes alternating within each repeat, and the per-repeat
paired ratio capacity ÷ fixed (runs made back to back share the machine's state).
WAVES=N runs a steady load instead of closed batches: N x C requests, at most C in flight.
OUT=. [CONC="1 64"] [REPEATS=9] [TOKENS=256] [WAVES=1] [NAME=capacity_paired] python capacity_paired.py"""
import json, os, statistics, time, torch
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.records import split_raw, write_record
from dspark.tools.capacity_sweep import capacity_sweep
OUT = os.environ.get("OUT")
t0 = time.time()
CONC = tuple(int(c) for c in os.environ.get("CONC", "1 4 16 64").split())
rows = capacity_sweep(DEFAULT_MODEL, concurrencies=CONC, max_tokens=int(os.environ.get("TOKENS", 256)),
                      repeats=int(os.environ.get("REPEATS", 7)), waves=int(os.environ.get("WAVES", 1)))
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "paired": {}}
by = {(r["mode"], r["concurrency"]): r for r in rows}
for c in CONC:
    f, k, n = by["fixed", c]["tok_s_runs"], by["capacity", c]["tok_s_runs"], by["none", c]["tok_s_runs"]
    cap_fixed = sorted(b / a for a, b in zip(f, k))
    res["paired"][c] = {"capacity_over_fixed_median": round(statistics.median(cap_fixed), 4),
                        "capacity_over_fixed_range": [round(cap_fixed[0], 4), round(cap_fixed[-1], 4)],
                        "capacity_over_none_median": round(statistics.median(b / a for a, b in zip(n, k)), 4),
                        "fixed_over_none_median": round(statistics.median(b / a for a, b in zip(n, f)), 4)}
    print(c, json.dumps(res["paired"][c]), flush=True)
for r in rows: print(r["mode"], r["concurrency"], round(r["tok_s"], 1), round(r["mean_acceptance_length"], 2),
                     r["active_steps"], r["bypassed_steps"], r["kept_drafts"], r["proposed_drafts"], flush=True)
res["wall_s"] = round(time.time() - t0, 1)
write_record(os.environ.get("NAME", "capacity_paired"), command="python benchmarks/scripts/capacity_paired.py", folder=OUT,
             **split_raw(res))
