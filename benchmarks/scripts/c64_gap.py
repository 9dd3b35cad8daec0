"""Why fixed-K DSpark at 64 requests beat no-spec in the bench (1.22x, default_tc.json) but lost to it in the
capacity sweep (0.81x, capacity_closed_tc.json): the two differ in prompts (the bench's `heldout_prompts`, the
sweep's `sweep_prompts`) and in how the engines are built (the bench's `decode_run` builds one per mode; the sweep
builds a no-spec engine and one capacity-control engine that fixed K shares with the controller detached).
This crosses them on one machine: closed batches of 64 (and 1) requests, 128 greedy tokens after 128-token prompts,
REPEATS runs per cell taking turns, plus one run per cell that syncs after every step (prefill and decode step
times). `dspark_late0` is the `dspark` engine with `draft_ahead` off (a request's first drafts read before its first
round is laid out, as before chapter 25 launched that round behind the draft step). Greedy tokens of every DSpark
cell are compared with the no-spec engine's. OUT=. [REPEATS=5] [CONC="64 1"] [BENCH_RUNS=1] [NAME=c64_gap] python c64_gap.py"""
import json, os, statistics, time, torch
from dspark.tools.bench import _default_model_prompts, timed_batch, decode_run, machine
from dspark.tools.capacity_sweep import capacity_attached, sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.engine.core import frozen_heap
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams

OUT, REPEATS = os.environ["OUT"], int(os.environ.get("REPEATS", 5))
CONC = tuple(int(c) for c in os.environ.get("CONC", "64 1").split())
T0 = time.time()
prompts = {"bench": _default_model_prompts(DEFAULT_MODEL, 64, 128), "sweep": sweep_prompts(DEFAULT_MODEL, 64, 128)}
res = {"machine": machine(), "repeats": REPEATS, "bench_runs": [], "cells": {}}

# 1. the bench's own decode_run (an engine per mode and prompt set); BENCH_RUNS=0 skips it
for name, P in (prompts.items() if int(os.environ.get("BENCH_RUNS", 1)) else ()):
    for mode in (None, "dspark"):
        r = decode_run(DEFAULT_MODEL, P[:64], mode, 5 if mode else None, 128, "cuda", "bfloat16", repeats=REPEATS)
        r.pop("token_ids"); r["prompts"] = name; res["bench_runs"].append(r)
        print("decode_run", name, r["mode"], r["tok_s"], r["mean_acceptance_length"], r["decode_step_ms"], flush=True)

# 2. the sweep's engines: no-spec, DSpark without capacity control, DSpark with it (detached = fixed K)
def build(spec, cap):
    return LLM(DEFAULT_MODEL, speculative=spec, num_speculative_tokens=5 if spec else None, capacity=cap,
               device="cuda", dtype="bfloat16", seed=0, max_num_seqs=64, max_num_batched_tokens=64 * 134,
               max_model_len=128 + 128 + 7, enable_prefix_caching=False, kv_cache_memory_bytes=2 * 2**30)
engines = {"none": (build(None, None), False, True), "dspark": (build("dspark", None), False, True)}
engines["dspark_late0"] = (engines["dspark"][0], False, False)
engines["cap_detached"] = (build("dspark", "auto"), False, True)
engines["cap_attached"] = (engines["cap_detached"][0], True, True)
for llm, _, _ in engines.values():
    llm.generate(prompts["bench"][:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)

def one(llm, P, c, per_step, ahead):
    llm.runner.draft_ahead = ahead
    sps = [SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, seed=i) for i in range(c)]
    b = llm.spec_stats()
    wall, steps, outs = timed_batch(llm, P[:c], sps, per_step, "cuda")
    a = llm.spec_stats()
    d = a["num_drafts"] - b["num_drafts"]
    acc = 1 + (a["num_accepted_tokens"] - b["num_accepted_tokens"]) / d if d else 1.0
    return wall, steps, acc, [o.outputs[0].token_ids for o in outs]

for c in CONC:
    for name, P in prompts.items():
        runs = {e: [] for e in engines}
        order = list(engines)
        for rep in range(REPEATS):
            for e in (order if rep % 2 == 0 else order[::-1]):
                llm, on, ahead = engines[e]
                with capacity_attached(llm, on), frozen_heap():
                    wall, _, acc, toks = one(llm, P, c, False, ahead)
                runs[e].append((sum(map(len, toks)) / wall, acc))
        for e in order:
            llm, on, ahead = engines[e]
            with capacity_attached(llm, on), frozen_heap():
                _, steps, acc, toks = one(llm, P, c, True, ahead)
            if e == "none": ref = toks
            pre = [round(1e3 * t, 3) for t, p in steps if p]
            dec = sorted(1e3 * t for t, p in steps if not p)
            cell = {"tok_s_runs": [round(t, 1) for t, _ in runs[e]], "tok_s": round(statistics.median(t for t, _ in runs[e]), 1),
                    "acceptance": round(runs[e][0][1], 3), "steps": len(steps), "prefill_steps_ms": pre,
                    "first_decode_steps_ms": [round(1e3 * t, 3) for t, p in steps if not p][:4],
                    "decode_step_ms_median": round(dec[len(dec) // 2], 3) if dec else None,
                    "decode_ms_total": round(sum(dec), 2),
                    "same_tokens_as_none": sum(a == b for a, b in zip(toks, ref)), "first_rounds": llm.runner.round_ahead.first
                    if llm.runner.round_ahead else None}
            res["cells"][f"C{c} {name} {e}"] = cell
            print(f"C{c} {name:5s} {e:12s}", json.dumps(cell), flush=True)
        pair = lambda x, y: round(statistics.median(a / b for (a, _), (b, _) in zip(runs[x], runs[y])), 4)
        res["cells"][f"C{c} {name} paired"] = p = {f"{e}/none": pair(e, "none") for e in order[1:]}
        p["dspark/dspark_late0"], p["cap_attached/cap_detached"] = pair("dspark", "dspark_late0"), pair("cap_attached", "cap_detached")
        print(f"   C{c} {name} paired medians", json.dumps(p), flush=True)
res["wall_s"] = round(time.time() - T0, 1)
json.dump(res, open(f"{OUT}/{os.environ.get('NAME', 'c64_gap')}.json", "w"), indent=1)
