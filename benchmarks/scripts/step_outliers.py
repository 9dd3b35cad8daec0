"Per-step host wall times of a C1 no-spec run without a sync per step (the bench's engine settings, and max_num_seqs=16): where the 128 steps' time goes. OUT=. python step_outliers.py"
import json, os, time, gc, statistics, torch, dspark
from dspark.tools.bench import _default_model_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]; res = {}
prompts = _default_model_prompts(DEFAULT_MODEL, 1, 128)
for tag, seqs, mml, spec in (("bench_none", 1, 264, None), ("seqs16_none", 16, 1024, None), ("bench_dspark", 1, 269, "dspark")):
    llm = dspark.LLM(DEFAULT_MODEL, speculative=spec, device="cuda", dtype="bfloat16", max_num_seqs=seqs, max_model_len=mml,
                     max_num_batched_tokens=2048, kv_cache_memory_bytes=4 * 2**30)
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for rep in range(3):
        gcs = gc.get_count()
        torch.cuda.synchronize(); t0 = time.perf_counter()
        llm.add_request(prompts[0], sp, request_id="x"); ts = []
        while llm.has_unfinished_requests():
            s = time.perf_counter(); llm.step(); ts.append(1e3 * (time.perf_counter() - s))
        torch.cuda.synchronize(); wall = time.perf_counter() - t0
        llm.pop_output("x")
        q = sorted(ts)
        r = {"tok_s": round(128 / wall, 1), "steps": len(ts), "sum_ms": round(sum(ts), 2), "median_ms": round(q[len(q) // 2], 3),
             "p90_ms": round(q[int(0.9 * len(q))], 3), "max_ms": round(q[-1], 2), "top5": [round(x, 2) for x in q[-5:]],
             "slow_idx": [i for i, x in enumerate(ts) if x > 3 * q[len(q) // 2]]}
        res[f"{tag}_{rep}"] = r
        print(tag, rep, json.dumps(r), flush=True)
    del llm; torch.cuda.empty_cache()
json.dump(res, open(OUT + "/step_outliers.json", "w"), indent=1)
