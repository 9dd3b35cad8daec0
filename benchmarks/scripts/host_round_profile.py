"""The host's path from reading a DSpark round's verification to launching the next round, at one request on the
GPU (the embedded model, bf16, as `python -m dspark.bench` builds it): per call medians of the pieces (perf_counter
wrappers), then a cProfile of `RoundAhead.launch_next` alone. OUT=. python host_round_profile.py"""
import cProfile, collections, io, json, os, pstats, statistics, time, torch, dspark
import dspark.runtime.fused_round as FR, dspark.runtime.overlap as OV, dspark.runtime.graphs as G, dspark.engine.core as E
from dspark.tools.bench import _default_model_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams

OUT = os.environ["OUT"]
T = collections.defaultdict(list)
def timed(owner, name, label=None):
    f = getattr(owner, name)
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[label or name].append(time.perf_counter() - t); return r
    setattr(owner, name, w)
    return f

prompts = _default_model_prompts(DEFAULT_MODEL, 1, 128)
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device="cuda", dtype="bfloat16", max_num_seqs=1,
                 max_num_batched_tokens=8192, max_model_len=128 + 128 + 13, enable_prefix_caching=False)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
llm.generate(prompts, sp, use_tqdm=False)
for owner, name in [(OV.RoundAhead, "launch_next"), (OV.RoundAhead, "take"), (FR.RoundGraphs, "launch"),
                    (FR.RoundGraphs, "read"), (FR.RoundGraphs, "snapshot"), (torch.cuda.CUDAGraph, "replay"),
                    (llm, "step"), (llm.scheduler, "schedule"), (llm.runner, "execute")]:
    timed(owner, name)
fill0 = FR.fill_layout
def fill(*a, **k):
    t = time.perf_counter(); r = fill0(*a, **k); T["fill_layout"].append(time.perf_counter() - t); return r
FR.fill_layout = fill
res = {"runs": []}
for _ in range(3):
    T.clear()
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); wall = time.perf_counter() - t
    res["runs"].append({"wall_ms": round(wall * 1e3, 2),
                        **{k: [len(v), round(statistics.median(v) * 1e6, 1)] for k, v in T.items()}})
    print(json.dumps(res["runs"][-1]), flush=True)
prof = cProfile.Profile()
launch_next = OV.RoundAhead.launch_next
def profiled(*a, **k):
    prof.enable()
    try: return launch_next(*a, **k)
    finally: prof.disable()
OV.RoundAhead.launch_next = profiled
llm.generate(prompts, sp, use_tqdm=False)
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
res["cprofile_launch_next"] = s.getvalue()
print(s.getvalue()[:6000], flush=True)
json.dump(res, open(f"{OUT}/host_round_profile.json", "w"), indent=1)
