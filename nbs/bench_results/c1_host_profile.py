"""The host's whole cycle per DSpark round at one request on the GPU (the embedded model, bf16, graphs, as the bench
builds it): a cProfile of `REPEATS` generations (128 tokens after a 128-token prompt), top functions by own time,
with the time spent waiting for the device (event waits and reads that sync) counted apart, so host work per round
= (profiled time − waits) / rounds. OUT=. [REPEATS=6] python c1_host_profile.py"""
import cProfile, io, json, os, pstats, time, torch, dspark
from dspark.tools.bench import _default_model_prompts, frozen_heap
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams

OUT, REPEATS = os.environ["OUT"], int(os.environ.get("REPEATS", 6))
prompts = _default_model_prompts(DEFAULT_MODEL, 3, 128)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device="cuda", dtype="bfloat16", max_num_seqs=1,
                 max_num_batched_tokens=8192, max_model_len=128 + 128 + 13, enable_prefix_caching=False,
                 kv_cache_memory_bytes=2**30)
for p in prompts: llm.generate([p], sp, use_tqdm=False)
r0 = llm.runner.round_ahead.rounds.replays
prof = cProfile.Profile()
t = time.perf_counter()
with frozen_heap():
    prof.enable()
    for i in range(REPEATS): llm.generate([prompts[i % 3]], sp, use_tqdm=False)
    prof.disable()
wall = time.perf_counter() - t
rounds = llm.runner.round_ahead.rounds.replays - r0
st = pstats.Stats(prof)
waits = sum(v[2] for k, v in st.stats.items() if k[2] in ("<method 'synchronize' of 'torch._C._CudaEventBase' objects>",)
            or "Event.synchronize" in k[2] or k[2] == "<method 'tolist' of 'torch._C.TensorBase' objects>")
total = st.total_tt
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
c = io.StringIO(); pstats.Stats(prof, stream=c).sort_stats("cumulative").print_stats(45)
res = {"gpu": torch.cuda.get_device_name(), "repeats": REPEATS, "rounds": rounds, "wall_ms": round(wall * 1e3, 1),
       "profiled_ms": round(total * 1e3, 1), "wait_ms": round(waits * 1e3, 1),
       "host_us_per_round": round((total - waits) / rounds * 1e6, 1), "wall_us_per_round": round(wall / rounds * 1e6, 1),
       "tottime": s.getvalue(), "cumulative": c.getvalue()}
print(json.dumps({k: v for k, v in res.items() if k not in ("tottime", "cumulative")}), flush=True)
print(s.getvalue()[:7000]); print(c.getvalue()[:9000])
json.dump(res, open(f"{OUT}/c1_host_profile.json", "w"), indent=1)
