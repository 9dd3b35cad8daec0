"""Capacity control's depth 0 on the H200 (embedded model, bf16, graphs, greedy, 128 tokens after 128-token held-out
prompts): no speculation, fixed-K DSpark, the DSpark engine held at depth 0 (plain decoding: its decode graphs
still write the drafter's context, and chapter 25 queues each step early) and the measured switch, taking turns
within each repeat on one engine per kind. WAVES=N: a steady load of N x C requests, at most C in flight.
OUT=. [CONC="16 64"] [REPEATS=5] [WAVES=1] [NAME=plain_gpu] python plain_gpu.py"""
import json, os, statistics, time
import torch
from dspark.spec.online import PlainSwitch
from dspark.tools.capacity_sweep import capacity_attached, sweep_run, sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.engine.core import frozen_heap
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams
CONC = tuple(int(c) for c in os.environ.get("CONC", "16 64").split())
REPEATS, TOKENS, K = int(os.environ.get("REPEATS", 5)), 128, 5
WAVES = int(os.environ.get("WAVES", 1))
top = max(CONC)
prompts = sweep_prompts(DEFAULT_MODEL, top * WAVES, 128)
build = lambda spec: LLM(DEFAULT_MODEL, speculative=spec, num_speculative_tokens=K if spec else None,
                         capacity="auto" if spec else None, device="cuda", dtype="bfloat16", max_num_seqs=top,
                         max_num_batched_tokens=max(1024, top * (128 + K + 1)), max_model_len=128 + TOKENS + K + 2,
                         enable_prefix_caching=False, kv_cache_memory_bytes=2 * 2**30)
none, spec = build(None), build("dspark")
for llm in (none, spec): llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
cap = spec.runner.capacity
real_decide = PlainSwitch.decide
def run(mode, c):
    llm = none if mode == "none" else spec
    if mode == "plain": PlainSwitch.decide = lambda self, R: setattr(self, "plain", True) or True
    try:
        with capacity_attached(llm, mode in ("plain", "switch")), frozen_heap():
            r = sweep_run(llm, mode, c, prompts, 0.0, TOKENS, 0, torch.cuda.synchronize, WAVES)
    finally: PlainSwitch.decide = real_decide
    ra, da = llm.runner.round_ahead, llm.runner.ahead
    r.update(rounds_ahead_used=ra.used if ra else 0, steps_ahead_used=da.used if da else 0)
    return r
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "knee": cap.activation, "rows": [], "paired": {}}
modes = ("none", "fixed", "plain", "switch")
t0 = time.time()
for c in CONC:
    runs = {m: [] for m in modes}
    for rep in range(REPEATS):
        for m in (modes if rep % 2 == 0 else modes[::-1]): runs[m].append(run(m, c))
    for m in modes:
        res["rows"].append({"mode": m, "concurrency": c, "tok_s_runs": [round(r["tok_s"], 1) for r in runs[m]],
                            "tok_s_median": round(statistics.median(r["tok_s"] for r in runs[m]), 1),
                            "plain_steps": sum(r["plain_steps"] for r in runs[m]),
                            "steps_ahead_used": runs[m][-1]["steps_ahead_used"],
                            "mean_acceptance_length": round(statistics.median(r["mean_acceptance_length"] for r in runs[m]), 3)})
        print(json.dumps(res["rows"][-1]), flush=True)
    res["paired"][c] = {f"{m}_over_none": round(statistics.median(b["tok_s"] / a["tok_s"] for a, b in zip(runs["none"], runs[m])), 4)
                        for m in modes[1:]}
    print(c, res["paired"][c], flush=True)
res["wall_s"] = round(time.time() - t0, 1)
json.dump(res, open(os.environ.get("OUT", ".") + f"/{os.environ.get('NAME', 'plain_gpu')}.json", "w"), indent=1)
