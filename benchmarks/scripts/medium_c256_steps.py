"""Where a 256-request medium decode step goes (H200, bf16, graphs), on a layout where all 256 requests decode:
the whole batch prefills in one step, so every request decodes from the same step on. Per real decode step: host
wall time of each engine part (synchronised), and the graph replay alone on the final layout (kernels by name).
OUT=. python medium_c256_steps.py
As run (medium_c256_steps.json), `parts_ms_per_step` divides each part's total over the whole timed generate by 64,
and that generate includes its one 32,768-token prefill step: they are not decode-step figures. The replay
profiles (`decode_256`, `decode_64`) are."""
import collections, json, os, sys, tempfile, time, torch, dspark
sys.path.insert(0, os.path.dirname(__file__))
from dspark.sample.sampling import SamplingParams
from round_profile_lib import ev_time, kernels
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
pool = torch.randint(2, 32768, (256, 128), generator=torch.Generator().manual_seed(0)).tolist()
llm = dspark.LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=256, max_model_len=400,
                 max_num_batched_tokens=32768, kv_cache_memory_bytes=2**31, enable_prefix_caching=False)
sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(pool, sp, use_tqdm=False)
T = collections.Counter()
def timed(obj, name, sync):
    f = getattr(obj, name)
    def w(*a, **k):
        if sync: torch.cuda.synchronize()
        t = time.perf_counter(); r = f(*a, **k)
        if sync: torch.cuda.synchronize()
        T[name] += time.perf_counter() - t; return r
    setattr(obj, name, w)
for o, n, sync in ((llm.scheduler, "schedule", 0), (llm.runner, "execute", 1), (llm.scheduler, "update", 0),
                  (llm, "_advance", 0), (llm, "step", 1)):
    timed(o, n, sync)
llm.generate(pool, sp, use_tqdm=False)
steps = 64
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
       "parts_ms_per_step": {k: round(v / steps * 1e3, 3) for k, v in T.items()}}
print(res, flush=True)
for n in (256, 64):
    fn = llm.graphs.graphs[next(s for s in llm.graphs.sizes if s >= n)][0].replay
    res[f"decode_{n}"] = {"wall_ms": round(ev_time(fn), 4), **kernels(fn, 20)}
    print(n, json.dumps(res[f"decode_{n}"])[:1500], flush=True)
json.dump(res, open(os.environ["OUT"] + "/medium_c256_steps.json", "w"), indent=1)
