"""Is K = 5 the best fixed draft depth under load? (chapter 21) One engine per depth (num_speculative_tokens = 5, 4, 3,
2, each with its own round graphs) and a no-spec engine, under a steady load (`WAVES x C` requests, at most C in flight,
128-token held-out prompts, TOKENS each), the arms taking turns in a rotating order; per concurrency the paired median of
each depth's throughput over K = 5's. Also the SPS curve the K = 5 engine profiled at start-up.
OUT=. [CONC="16 64"] [WAVES=4] [REPEATS=7] [TOKENS=128] [DEPTHS="5 4 3 2"] [NAME=depth_sweep] python depth_sweep.py"""
import json, os, statistics, time, torch
from dspark.tools.capacity_sweep import capacity_attached, sweep_run, sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.records import split_raw, write_record
from dspark.engine.core import frozen_heap
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams

OUT, t0 = os.environ.get("OUT"), time.time()
CONC = [int(c) for c in os.environ.get("CONC", "16 64").split()]
DEPTHS = [int(k) for k in os.environ.get("DEPTHS", "5 4 3 2").split()]
WAVES, REPEATS, TOKENS = (int(os.environ.get(k, d)) for k, d in (("WAVES", 4), ("REPEATS", 7), ("TOKENS", 128)))
top = max(CONC)
prompts = sweep_prompts(DEFAULT_MODEL, top * WAVES, 128)
def build(K):
    return LLM(DEFAULT_MODEL, speculative="dspark" if K else None, num_speculative_tokens=K or None,
               capacity="auto" if K == 5 else None, device="cuda", dtype="bfloat16", seed=0, max_num_seqs=top,
               max_num_batched_tokens=max(1024, top * 134), max_model_len=128 + TOKENS + 7,
               enable_prefix_caching=False, kv_cache_memory_bytes=2 * 2**30)
engines = {}
for K in [0] + DEPTHS:
    t = time.time(); engines[K] = build(K)
    engines[K].generate(prompts[:top], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    print("built", K, round(time.time() - t, 1), flush=True)
from dspark.timing import device_ms as replay_ms
anatomy = {}
for K, e in engines.items():        # device ms of the captured steps at the top load, every row padding
    fwd = e.runner.forward
    a = {"decode_or_verify_ms": {n: round(fwd.step_ms(n, 20), 4) for n in fwd.sizes if n >= top}}
    rounds, dg = getattr(fwd, "rounds", None), getattr(e.runner.proposer, "graphs", None)
    if dg is not None: a["draft_step_ms"] = round(dg.step_ms(top, 20), 4)
    if rounds is not None and rounds.graphs:
        b = rounds.bucket(top); rounds._pad_only(b)
        a["round_ms"], a["round_rows"] = round(replay_ms(rounds.graphs[b][0].replay, 20), 4), rounds.rows(top)
    anatomy[f"K{K}"] = a
    print("anatomy", K, a, flush=True)
curve = engines[5].runner.capacity.curve.to_json() if 5 in engines else None
arms = [0] + DEPTHS
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "waves": WAVES, "tokens": TOKENS,
       "sps_curve_k5": curve, "anatomy": anatomy, "runs": {}, "paired": {}}
for c in CONC:
    runs = {K: [] for K in arms}
    for rep in range(REPEATS + 1):                      # rep 0 warms every arm at this load: not kept
        order = arms[rep % len(arms):] + arms[:rep % len(arms)]
        for K in order:
            with capacity_attached(engines[K], False), frozen_heap():
                r = sweep_run(engines[K], f"K{K}", c, prompts, 0.0, TOKENS, 0, torch.cuda.synchronize, WAVES)
            if rep: runs[K].append(r)
        print(c, rep, {K: round(runs[K][-1]["tok_s"], 1) for K in arms} if rep else "warm-up", flush=True)
    res["runs"][c] = {f"K{K}": [dict(tok_s=round(r["tok_s"], 1), acceptance=round(r["mean_acceptance_length"], 3),
                                     wall_s=r["wall_s"]) for r in v] for K, v in runs.items()}
    base = runs[DEPTHS[0]]
    res["paired"][c] = {f"K{K}_over_K{DEPTHS[0]}": (lambda q: {"median": round(statistics.median(q), 4),
                        "range": [round(min(q), 4), round(max(q), 4)]})([b["tok_s"] / a["tok_s"] for a, b in zip(base, runs[K])])
                        for K in arms if K != DEPTHS[0]}
    res["paired"][c]["median_tok_s"] = {f"K{K}": round(statistics.median(r["tok_s"] for r in runs[K]), 1) for K in arms}
    res["paired"][c]["acceptance"] = {f"K{K}": round(statistics.median(r["mean_acceptance_length"] for r in runs[K]), 3) for K in arms}
    print(c, json.dumps(res["paired"][c]), flush=True)
res["wall_s"] = round(time.time() - t0, 1)
write_record(os.environ.get("NAME", "depth_sweep"), command="python benchmarks/scripts/depth_sweep.py", folder=OUT,
             **split_raw(res))
