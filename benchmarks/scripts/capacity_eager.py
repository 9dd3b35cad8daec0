"""Capacity control against fixed K on the eager path (no CUDA graphs: the CPU, or CUDA with enforce_eager), where
the controller is active from two requests on: one DSpark engine built like `capacity_sweep`'s, fixed K (the
controller detached) and capacity control alternating, REPEATS paired runs per load of C requests of TOKENS tokens
after 128-token held-out prompts (closed batches). Records the auto-profiled SPS curve, the ratios and what the
controller kept. PKG_DIR times another exported tree of the package (an older build), as `sampled.py` does.
OUT=. [DEVICE=cpu] [CONC="16"] [REPEATS=3] [TOKENS=32] [NAME=capacity_eager] [PKG_DIR=.] python capacity_eager.py"""
import json, os, statistics, sys, time
pkg = os.path.abspath(os.environ.get("PKG_DIR", os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, pkg)
import torch, dspark
assert dspark.__file__.startswith(pkg), dspark.__file__
from dspark.tools.capacity_sweep import capacity_attached, sweep_run, sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.records import split_raw, write_record
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams

OUT, DEV = os.environ.get("OUT"), os.environ.get("DEVICE", "cpu")
CONC = [int(c) for c in os.environ.get("CONC", "16").split()]
REPEATS, TOKENS, K = int(os.environ.get("REPEATS", 3)), int(os.environ.get("TOKENS", 32)), 5
cuda = DEV.startswith("cuda")
top = max(CONC)
prompts = sweep_prompts(DEFAULT_MODEL, top, 128)
llm = LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=K, capacity="auto", device=DEV,
          dtype="bfloat16" if cuda else "float32", seed=0, max_num_seqs=top, max_num_batched_tokens=max(1024, top * (128 + K + 1)),
          max_model_len=128 + TOKENS + K + 2, enable_prefix_caching=False, enforce_eager=True,
          kv_cache_memory_bytes=2 * 2**30 if cuda else 256 * 2**20)
cap = llm.runner.capacity
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
sync = torch.cuda.synchronize if cuda else (lambda: None)
res = {"device": torch.cuda.get_device_name() if cuda else "cpu", "package": dspark.__file__, "torch": torch.__version__,
       "curve": cap.curve.to_json(), "activation": cap.activation, "policy": cap.config.policy, "tokens": TOKENS, "loads": {}}
t0 = time.time()
for c in CONC:
    runs = {"fixed": [], "capacity": []}
    for rep in range(REPEATS):
        for mode in (("fixed", "capacity") if rep % 2 == 0 else ("capacity", "fixed")):
            with capacity_attached(llm, mode == "capacity"):
                r = sweep_run(llm, mode, c, prompts, 0.0, TOKENS, 0, sync)
            r.pop("switch_rates", None)
            runs[mode].append(r)
    ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["fixed"], runs["capacity"])]
    res["loads"][c] = {"capacity_over_fixed": [round(x, 4) for x in ratios], "median": round(statistics.median(ratios), 4),
                       "fixed_tok_s": [round(r["tok_s"], 1) for r in runs["fixed"]],
                       "capacity_tok_s": [round(r["tok_s"], 1) for r in runs["capacity"]],
                       "acceptance": {m: round(statistics.median(r["mean_acceptance_length"] for r in v), 3) for m, v in runs.items()},
                       "kept_drafts": sum(r["kept_drafts"] for r in runs["capacity"]),
                       "proposed_drafts": sum(r["proposed_drafts"] for r in runs["capacity"]),
                       "active_steps": sum(r["active_steps"] for r in runs["capacity"]),
                       "bypassed_steps": sum(r["bypassed_steps"] for r in runs["capacity"])}
    print(c, json.dumps(res["loads"][c]), flush=True)
res["wall_s"], res["sts_temps"] = round(time.time() - t0, 1), [round(t, 3) for t in cap.sts.temps.tolist()] if cap.sts else None
print(json.dumps(res["curve"]), res["activation"], flush=True)
write_record(os.environ.get("NAME", "capacity_eager"), command="python benchmarks/scripts/capacity_eager.py", folder=OUT,
             **split_raw(res))
