"Host-side op breakdown of one C1 prefill step (default model, none and DSpark): torch.profiler CPU self time and cProfile cumulative. OUT=. python prefill_ops.py"
import time, json, os, io, cProfile, pstats, statistics, torch, dspark
from torch.profiler import profile, ProfilerActivity
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
print({k: v for k, v in os.environ.items() if "CUDA" in k or "TORCH" in k or "TRITON" in k})
print(open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0], os.cpu_count())
prompts = sweep_prompts(DEFAULT_MODEL, 8, 128)
for mode in (None, "dspark"):
    llm = dspark.LLM(DEFAULT_MODEL, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                     kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    sp = dspark.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    def fin():
        while llm.has_unfinished_requests(): llm.step()
    ts = []
    for i in range(3):
        llm.add_request(prompts[2 + i], sp, request_id=f"a{i}"); torch.cuda.synchronize()
        t = time.perf_counter(); llm.step(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t); fin()
    print(mode, "prefill ms", [round(1e3 * t, 2) for t in ts])
    llm.add_request(prompts[6], sp, request_id="b")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.step(); torch.cuda.synchronize()
    fin()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35, max_name_column_width=60))
    llm.add_request(prompts[7], sp, request_id="c")
    pr = cProfile.Profile(); pr.enable(); llm.step(); torch.cuda.synchronize(); pr.disable(); fin()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60); print(s.getvalue()[:9000])
    del llm; torch.cuda.empty_cache()
