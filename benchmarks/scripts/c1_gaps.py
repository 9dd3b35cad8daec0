"""Where a DSpark round's wall time at one request goes beyond its kernels (chapter 35): one generation (128 tokens
after a 128-token held-out prompt, the bench's engine settings) under torch.profiler, for no-spec and DSpark. From
the device timeline: wall, kernel-busy time, and the idle gaps between consecutive device operations, summed by the
pair of operations around them (the largest first), plus the first step (prefill and first drafts) apart.
OUT=. python c1_gaps.py"""
import collections, json, os, time, torch
from torch.profiler import profile, ProfilerActivity
from dspark.tools.bench import _default_model_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.engine.core import frozen_heap
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams

OUT = os.environ.get("OUT", ".")
prompts = _default_model_prompts(DEFAULT_MODEL, 1, 128)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
res = {"gpu": torch.cuda.get_device_name()}
for mode in (None, "dspark"):
    llm = LLM(DEFAULT_MODEL, speculative=mode, num_speculative_tokens=5 if mode else None, device="cuda", dtype="bfloat16",
              max_num_seqs=1, max_num_batched_tokens=8192, max_model_len=128 + 128 + 13, kv_cache_memory_bytes=2**30,
              enable_prefix_caching=False)
    for _ in range(3): llm.generate(prompts, sp, use_tqdm=False)
    marks = []
    step0 = llm.step
    def step():
        t = time.perf_counter(); out = step0(); marks.append((t, time.perf_counter())); return out
    llm.step = step
    with frozen_heap(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize(); t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        torch.cuda.synchronize(); wall = time.perf_counter() - t0
    ev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = sorted((e.time_range.start, e.time_range.end, e.name) for e in ev)
    busy = sum(b - a for a, b, _ in ops)
    gaps = collections.Counter(); count = collections.Counter()
    for (a0, a1, an), (b0, b1, bn) in zip(ops, ops[1:]):
        g = b0 - a1
        if g > 3:                                    # µs: more than a graph's own launch spacing
            key = f"{an[:40]} -> {bn[:40]}"; gaps[key] += g; count[key] += 1
    span = ops[-1][1] - ops[0][0]
    r = {"wall_ms": round(1e3 * wall, 2), "device_span_ms": round(span / 1e3, 2), "kernel_busy_ms": round(busy / 1e3, 2),
         "ops": len(ops), "steps": len(marks), "gap_ms_over_3us": round(sum(gaps.values()) / 1e3, 2),
         "top_gaps": [[k, round(v, 1), count[k]] for k, v in gaps.most_common(12)],
         "first_step_host_ms": round(1e3 * (marks[0][1] - marks[0][0]), 3) if marks else None,
         "spec": llm.spec_stats()}
    print(mode or "none", json.dumps(r, indent=0)[:2500], flush=True)
    res[mode or "none"] = r
    del llm; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/c1_gaps.json", "w"), indent=1)
