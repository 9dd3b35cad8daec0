"""Where the host's time goes on a DSpark round's critical path (chapter 35), on the current build: at one request,
the span from a round's verification being read (`RoundGraphs.read` returns) to the next round's graph replay being
issued (`RoundGraphs._replay` entered), which must fit inside the ~190 µs draft step for the GPU not to wait. Per
round: the span, and the replay call itself; a cProfile of the spans alone (top functions by own time). Then, at 64
requests under a steady load (`WAVES` x 64, the capacity sweep's client), a cProfile of whole engine steps, fixed K.
OUT=. [WAVES=4] python host_path_now.py"""
import cProfile, io, json, os, pstats, statistics, time, torch, dspark
import dspark.runtime.fused_round as FR
from dspark.tools.bench import _default_model_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams

OUT = os.environ["OUT"]
res = {"gpu": torch.cuda.get_device_name()}
prompts = _default_model_prompts(DEFAULT_MODEL, 1, 128)
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=5, device="cuda", dtype="bfloat16",
                 max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=128 + 128 + 13, kv_cache_memory_bytes=2**30,
                 enable_prefix_caching=False)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for _ in range(3): llm.generate(prompts, sp, use_tqdm=False)
prof, spans, replays, state = cProfile.Profile(), [], [], {"t": None}
read0, replay0 = FR.RoundGraphs.read, FR.RoundGraphs._replay
def read(self, handle):
    r = read0(self, handle)
    state["t"] = time.perf_counter(); prof.enable()
    return r
def _replay(self, *a, **k):
    if state["t"] is not None:
        prof.disable(); spans.append(time.perf_counter() - state["t"]); state["t"] = None
    t = time.perf_counter(); h = replay0(self, *a, **k); replays.append(time.perf_counter() - t)
    return h
FR.RoundGraphs.read, FR.RoundGraphs._replay = read, _replay
walls = []
for _ in range(5):
    t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); walls.append(time.perf_counter() - t)
    prof.disable(); state["t"] = None
FR.RoundGraphs.read, FR.RoundGraphs._replay = read0, replay0
q = lambda v, p: round(sorted(v)[int(p * (len(v) - 1))] * 1e6, 1)
s = io.StringIO(); pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
c = io.StringIO(); pstats.Stats(prof, stream=c).sort_stats("cumtime").print_stats(30)
res["c1"] = {"walls_ms": [round(w * 1e3, 2) for w in walls], "spans": len(spans),
             "span_us": {"p10": q(spans, .1), "median": q(spans, .5), "p90": q(spans, .9)},
             "replay_call_us": {"p10": q(replays, .1), "median": q(replays, .5), "p90": q(replays, .9)},
             "profile_tottime": s.getvalue(), "profile_cumtime": c.getvalue()}
print(json.dumps({k: v for k, v in res["c1"].items() if not k.startswith("profile")}), flush=True)
print(s.getvalue()[:5000], flush=True)
print(c.getvalue()[:5000], flush=True)
json.dump(res, open(f"{OUT}/host_path_now.json", "w"), indent=1)
del llm; torch.cuda.empty_cache()

# 64 requests, steady load, fixed K: whole steps under cProfile (the host bounds a step here)
from dspark.tools.capacity_sweep import capacity_attached, sweep_run
from dspark.engine.core import frozen_heap
from steady_engine import steady_engine
C, WAVES, REPEATS, TOKENS, prompts, llm = steady_engine(4)
step0, sprof, steps = llm.step, cProfile.Profile(), []
def step():
    t = time.perf_counter(); sprof.enable()
    try: return step0()
    finally: sprof.disable(); steps.append(time.perf_counter() - t)
for rep in range(3):
    if rep == 2: llm.step = step
    with capacity_attached(llm, False), frozen_heap():
        r = sweep_run(llm, "fixed", C, prompts, 0.0, TOKENS, 0, torch.cuda.synchronize, WAVES)
    print("fixed", rep, round(r["tok_s"], 1), flush=True)
llm.step = step0
s = io.StringIO(); pstats.Stats(sprof, stream=s).sort_stats("tottime").print_stats(40)
c = io.StringIO(); pstats.Stats(sprof, stream=c).sort_stats("cumtime").print_stats(40)
res["c64"] = {"tok_s_profiled": round(r["tok_s"], 1), "steps": len(steps), "step_ms_median": round(statistics.median(steps) * 1e3, 3),
              "profile_tottime": s.getvalue(), "profile_cumtime": c.getvalue()}
print(s.getvalue()[:6000], flush=True)
print(c.getvalue()[:6000], flush=True)
json.dump(res, open(f"{OUT}/host_path_now.json", "w"), indent=1)
