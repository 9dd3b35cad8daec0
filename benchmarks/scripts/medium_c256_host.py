"""Where the host's share of a 256-request medium decode step goes on the H200 machine (analysis): the bench's
C256 engine (bf16, graphs, 128-token prompts, 128 tokens each), timed by part with wall clocks (no extra syncs),
then under cProfile and torch.profiler (CPU side). OUT=. python medium_c256_host.py"""
import collections, cProfile, io, json, os, pstats, statistics, sys, tempfile, time, torch, dspark
import dspark.runtime.graphs as G
from dspark.sample.sampling import SamplingParams
from dspark.engine.core import frozen_heap
R = int(sys.argv[1]) if len(sys.argv) > 1 else 256
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
pool = torch.randint(2, 32768, (R, 128), generator=torch.Generator().manual_seed(0)).tolist()
llm = dspark.LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=R, max_num_batched_tokens=8192,
                 max_model_len=128 + 128 + 8, kv_cache_memory_bytes=4 * 2**30, enable_prefix_caching=False)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(pool, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
T = collections.defaultdict(list)
def timed(obj, name, key=None):
    f = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[key or name].append(time.perf_counter() - t); return r
    setattr(obj, name, w)
for o, n in ((llm.scheduler, "schedule"), (llm.runner, "execute"), (llm.scheduler, "update"), (llm, "step"),
             (llm, "_advance"), (llm.runner, "_finish")):
    timed(o, n)
timed(G, "fill_buffers")
g = llm.graphs
orig_call = type(g).__call__
def call(self, *a, **k):
    t = time.perf_counter(); r = orig_call(self, *a, **k); T["forward"].append(time.perf_counter() - t); return r
type(g).__call__ = call
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "requests": R}
with frozen_heap():
    torch.cuda.synchronize(); t0 = time.perf_counter()
    llm.generate(pool, sp, use_tqdm=False); torch.cuda.synchronize()
    res["wall_s"] = round(time.perf_counter() - t0, 3)
    n = len(T["step"])
    steps = T["step"]
    res["steps"] = n
    res["prefill_steps_ms"] = [round(s * 1e3, 2) for s in steps[:6]]
    dec = slice(8, None)
    res["decode_parts_ms"] = {k: round(statistics.median(v[dec] if len(v) == n else v[len(v) // 4:]) * 1e3, 3) for k, v in T.items()}
    res["decode_parts_count"] = {k: len(v) for k, v in T.items()}
    res["decode_sum_s"] = round(sum(steps[8:]), 3)
    print(json.dumps(res), flush=True)
    pr = cProfile.Profile(); pr.enable(); llm.generate(pool, sp, use_tqdm=False); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35); res["cprofile_tottime"] = s.getvalue()[-9000:]
    print(res["cprofile_tottime"], flush=True)
    from torch.profiler import profile, ProfilerActivity
    ids = [llm.add_request(p, sp) for p in pool]
    for _ in range(20): llm.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10): llm.step()
    while llm.has_unfinished_requests(): llm.step()
    for i in ids: llm.pop_output(i)
    res["torch_profiler_cpu"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    print(res["torch_profiler_cpu"], flush=True)
json.dump(res, open(os.environ.get("OUT", ".") + f"/medium_c{R}_host.json", "w"), indent=1)
