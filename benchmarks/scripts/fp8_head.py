"""The DSpark drafter's vocabulary projection, bf16 against the rowwise-FP8 head (`--fp8-draft-head`), on one GPU:
kernel time of one projection of M rows (`triton.testing.do_bench`, median) at the medium preset's (32768 x 1024)
and DeepSeek-V4-Flash's (129280 x 4096) head sizes with random weights, and the error against the bf16 product;
then the engine on the trained default model (C1, greedy DSpark, 128 tokens, 6 prompts alternating on/off).
Writes $OUT/fp8_head.json."""
import json, os, statistics, time
import torch, triton, dspark
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.model.drafter import RowwiseFP8Head
from dspark.sample.sampling import SamplingParams

OUT = os.environ["OUT"]
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "head": [], "engine": {}}
for V, D in ((32768, 1024), (129280, 4096)):
    W = torch.randn(V, D, device="cuda", dtype=torch.bfloat16) * 0.02
    fp8 = RowwiseFP8Head(W)
    for M in (5, 80, 320):
        x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
        bf = lambda: torch.nn.functional.linear(x, W).float()
        t_bf, t_f8 = triton.testing.do_bench(bf), triton.testing.do_bench(lambda: fp8(x))
        ref = bf()
        row = {"V": V, "D": D, "M": M, "bf16_ms": round(t_bf, 4), "fp8_ms": round(t_f8, 4), "speedup": round(t_bf / t_f8, 2),
               "max_rel_err": float((fp8(x) - ref).abs().max() / ref.abs().max()), "scaled_mm": fp8.scaled_mm}
        res["head"].append(row); print(json.dumps(row), flush=True)
    del W, fp8; torch.cuda.empty_cache()
MODEL = os.path.abspath("dspark/models/default")
prompts = sweep_prompts(MODEL, 6, 128)
llms = {f: dspark.LLM(MODEL, speculative="dspark", device="cuda", dtype="bfloat16", max_num_seqs=4, max_model_len=512,
                      kv_cache_memory_bytes=2**30, enable_prefix_caching=False, fp8_draft_head=f) for f in (False, True)}
sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
for llm in llms.values(): llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)
times, toks = {False: [], True: []}, {False: [], True: []}
for i, p in enumerate(prompts):
    for f in ((False, True) if i % 2 == 0 else (True, False)):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        out = llms[f].generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
        torch.cuda.synchronize(); times[f].append(128 / (time.perf_counter() - t0)); toks[f].append(out)
for f in (False, True):
    st = llms[f].spec_stats()
    res["engine"]["fp8" if f else "bf16"] = {"tok_s": round(statistics.median(times[f]), 1),
                                            "acceptance": round(st["mean_acceptance_length"], 3)}
res["engine"]["identical_tokens"] = toks[False] == toks[True]
print(json.dumps(res["engine"]))
json.dump(res, open(f"{OUT}/fp8_head.json", "w"), indent=1)
