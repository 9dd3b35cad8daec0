"""Where the host's time goes in a DSpark round launched ahead (chapter 25), on the H200 with the embedded model at
one request (C=64: at 64): wall time per round, and within it the host's waits for the verification and for the drafts, the
launch of the next round, and the rest. OUT=. [C=1] [DETAIL=1] python round_timeline.py [label]"""
import json, os, sys, time, statistics
import torch
from dspark.tools.bench import _default_model_prompts, machine
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams
import dspark.runtime.fused_round as F, dspark.runtime.overlap as O

acc = {}
def timed(cls, name, key):
    fn = getattr(cls, name)
    def wrap(*a, **k):
        t = time.perf_counter(); out = fn(*a, **k); acc.setdefault(key, []).append(time.perf_counter() - t); return out
    setattr(cls, name, wrap)
orig_sync = torch.cuda.Event.synchronize
def sync(self):
    t = time.perf_counter(); orig_sync(self); acc.setdefault("event_waits", []).append(time.perf_counter() - t)
torch.cuda.Event.synchronize = sync
timed(F.RoundGraphs, "read", "read (incl. verify wait)")
timed(F.RoundGraphs, "launch", "launch")
timed(O.RoundAhead, "launch_next", "launch_next")
if hasattr(F.RoundGraphs, "_unpack"): timed(F.RoundGraphs, "_unpack", "drafts (incl. wait)")
else: timed(F.RoundGraphs, "_fetch", "drafts (incl. wait)")
if os.environ.get("DETAIL"):                    # the finer split of the host's round
    import dspark.runtime.buffers as G, dspark.runtime.runner as R, dspark.engine.core as E
    for cls, name in ((torch.cuda.CUDAGraph, "replay"), (G.HostStage, "send"), (G.HostStage, "wait"),
                      (R.ModelRunner, "settle"), (R.ModelRunner, "execute"), (R.ModelRunner, "_finish"),
                      (R.ModelRunner, "_verify_round"), (R.ModelRunner, "_propose_all"), (R.ModelRunner, "_adopt"),
                      (F.RoundGraphs, "snapshot"), (E.EngineCore, "_advance")):
        timed(cls, name, f"{cls.__name__}.{name}")
    from dspark.engine.scheduler import Scheduler
    timed(Scheduler, "schedule", "Scheduler.schedule"); timed(Scheduler, "update", "Scheduler.update")
    fl = F.fill_layout
    def fill(*a, **k):
        t = time.perf_counter(); fl(*a, **k); acc.setdefault("fill_layout", []).append(time.perf_counter() - t)
    F.fill_layout = fill
    if hasattr(O, "_to_device"): timed_fn = O._to_device
label = sys.argv[1] if len(sys.argv) > 1 else "run"
C = int(os.environ.get("C", 1))
prompts = _default_model_prompts(DEFAULT_MODEL, C, 128)
llm = LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=5, device="cuda", dtype="bfloat16",
          max_num_seqs=C, max_model_len=128 + 256 + 16, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
timed(type(llm), "step", "engine step")
sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
llm.generate(prompts, sp, use_tqdm=False)
res = {"label": label, "machine": machine(), "runs": []}
for rep in range(3):
    acc.clear()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    out = llm.generate(prompts, sp, use_tqdm=False)
    torch.cuda.synchronize(); wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in out)
    row = {"tok_s": round(n / wall, 1), "steps": len(acc["engine step"]),
           **{k: {"calls": len(v), "mean_us": round(1e6 * statistics.mean(v), 1), "total_ms": round(1e3 * sum(v), 2)}
              for k, v in acc.items()}}
    res["runs"].append(row)
    print(label, json.dumps(row), flush=True)
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    torch.cuda.synchronize(); t0 = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False); torch.cuda.synchronize(); wall = time.perf_counter() - t0
spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
busy, end = 0.0, -1.0
for a, b in spans:
    if b <= end: continue
    busy += b - max(a, end); end = b
res["profiled"] = {"wall_ms": round(1e3 * wall, 2), "gpu_busy_ms": round(busy / 1e3, 2),
                   "gpu_span_ms": round((spans[-1][1] - spans[0][0]) / 1e3, 2) if spans else None}
print(label, "profiled", res["profiled"], flush=True)
ra = llm.runner.round_ahead
res["rounds_ahead_used"], res["rounds_ahead_dropped"] = (ra.used, ra.dropped) if ra else (0, 0)
print(label, "ahead used/dropped", res["rounds_ahead_used"], res["rounds_ahead_dropped"])
json.dump(res, open(os.environ.get("OUT", ".") + f"/round_timeline_{label}.json", "w"), indent=1)
