"C1 A/B on the default model (bf16, graphs): no-spec and DSpark (fused rounds) alternated in one process, 7 repeats."
import json, os, time, statistics, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]
prompts = sweep_prompts(DEFAULT_MODEL, 7, 128)
llms = {m: dspark.LLM(DEFAULT_MODEL, speculative=None if m == "none" else m, device="cuda", dtype="bfloat16",
                      max_num_seqs=16, max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
        for m in ("none", "dspark")}
def run(llm, prompt, n):
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id="x")
    torch.cuda.synchronize(); t0 = time.perf_counter()
    llm.step(); torch.cuda.synchronize(); t1 = time.perf_counter()
    steps = 0
    while llm.has_unfinished_requests(): llm.step(); steps += 1
    torch.cuda.synchronize(); t2 = time.perf_counter()
    out = llm.pop_output("x").outputs[0].token_ids
    return {"total_tok_s": n / (t2 - t0), "decode_tok_s": (n - 1) / (t2 - t1), "prefill_ms": 1e3 * (t1 - t0), "steps": steps}, out
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
for n in (96, 256):
    rows = {"none": [], "dspark": []}
    for llm in llms.values(): run(llm, prompts[0], 16)                      # warm
    for rep in range(7):
        for m in (("none", "dspark") if rep % 2 == 0 else ("dspark", "none")):
            r, toks = run(llms[m], prompts[rep], n)
            rows[m].append(r); rows[m][-1]["toks"] = toks
    same = all(a["toks"] == b["toks"] for a, b in zip(rows["none"], rows["dspark"]))
    med = lambda m, k: statistics.median(r[k] for r in rows[m])
    res[n] = {"identical_tokens": same, **{f"{m}_{k}": round(med(m, k), 1) for m in rows for k in ("total_tok_s", "decode_tok_s", "prefill_ms")},
              "ratio_total": round(med("dspark", "total_tok_s") / med("none", "total_tok_s"), 3),
              "ratio_decode": round(med("dspark", "decode_tok_s") / med("none", "decode_tok_s"), 3),
              "ratios_total_per_pair": [round(b["total_tok_s"] / a["total_tok_s"], 3) for a, b in zip(rows["none"], rows["dspark"])],
              "spec": llms["dspark"].spec_stats()}
    print(n, json.dumps(res[n]), flush=True)
json.dump(res, open(f"{OUT}/ab_c1.json", "w"), indent=1)
