"Prefix-cache hits on the GPU (default model, bf16): the first step of a repeated 300-token prompt (a hit that resumes before the cached end) against a miss, with graphs and with enforce_eager, for no-spec and DSpark; greedy tokens graph vs eager. OUT=. [DTYPE=float32] [MODES=none,dspark] python prefix_hits.py"
import json, os, time, statistics, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
DTYPE = os.environ.get("DTYPE", "bfloat16"); MODES = [None if m == "none" else m for m in os.environ.get("MODES", "none,dspark").split(",")]
res["dtype"] = DTYPE
prompts = sweep_prompts(DEFAULT_MODEL, 5, 300)
sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
for mode in MODES:
    toks = {}
    for eager in (False, True):
        llm = dspark.LLM(DEFAULT_MODEL, speculative=mode, device="cuda", dtype=DTYPE, max_num_seqs=16,
                         max_model_len=1024, kv_cache_memory_bytes=2**30, enforce_eager=eager)
        llm.generate(prompts[4:], sp, use_tqdm=False); llm.generate(prompts[4:], sp, use_tqdm=False)   # warm: a miss, a hit
        def first_step(p, rid):
            llm.add_request(p, sp, request_id=rid); torch.cuda.synchronize()
            t = time.perf_counter(); llm.step(); torch.cuda.synchronize(); ms = 1e3 * (time.perf_counter() - t)
            while llm.has_unfinished_requests(): llm.step()
            return ms, llm.pop_output(rid).outputs[0].token_ids
        miss, hit, out = [], [], []
        for i in range(4):
            m, a = first_step(prompts[i], f"m{i}"); h, b = first_step(prompts[i], f"h{i}")
            miss.append(m); hit.append(h); out.append((a, b))
        g = llm.graphs
        r = {"miss_first_step_ms": round(statistics.median(miss), 2), "hit_first_step_ms": round(statistics.median(hit), 2),
             "hit_ms": [round(x, 2) for x in hit], "prefix_cache": llm.prefix_cache_stats(),
             "hit_equals_miss_tokens": sum(a == b for a, b in out), "eager_steps": g.eager_steps if g else None}
        toks[eager] = out
        res[f"{mode or 'none'}_{'eager' if eager else 'graphs'}"] = r
        print(mode, eager, json.dumps(r), flush=True)
        del llm; torch.cuda.empty_cache()
    res[f"{mode or 'none'}_graph_vs_eager_identical"] = toks[False] == toks[True]
    print(mode, "graph == eager:", toks[False] == toks[True], flush=True)
json.dump(res, open(OUT + f"/prefix_hits{'' if DTYPE == 'bfloat16' else '_' + DTYPE}.json", "w"), indent=1)
