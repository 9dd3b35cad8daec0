"""Where a C1 decode step's time goes at DeepSeek-V4-Flash width (all 256 experts, dummy weights as stored): the GPU
kernels of a few decode steps under torch.profiler, grouped by kernel name, per step (a run of the prefill and first token
alone is subtracted), beside the step's wall time.

    python benchmarks/scripts/v4_flash_profile.py [--layers 4] [--steps 16]     # writes $OUT/v4_flash_profile.json

With `--graphs` the steps replay their CUDA graphs (the serving path: fused mHC, one-launch norms) and the profiler
reports the kernels inside the replays; without it the eager step runs, kernel by kernel.

    python benchmarks/scripts/v4_flash_profile.py --prefill 4096 [--layers 2]   # $OUT/v4_flash_profile_prefill.json

`--prefill N`: the kernels of one N-token prefill instead (its first token included), each kernel's µs and achieved
share of the prefill's time, beside its wall time. It always builds the graphs, as the server does: an engine without
them runs its eager steps with the reference mHC (record `prefill_rows_mix` profiled that path by mistake).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch


def by_kernel(run) -> dict:
    "Device µs and launches by kernel name over `run()` (a generate), under torch.profiler."
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    by = defaultdict(lambda: [0.0, 0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            by[e.name][1] += 1
    return by


def main(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import dspark
    llm = dspark.LLM(model="deepseek-v4-flash", load_format="dummy", quantization="auto",
                     hf_overrides={"num_hidden_layers": a.layers}, device="cuda", dtype="bfloat16",
                     enforce_eager=not (a.graphs or a.prefill),
                     max_model_len=max(4096, a.prefill + 64), max_num_seqs=4, max_num_batched_tokens=max(1024, a.prefill),
                     gpu_memory_utilization=0.92, enable_prefix_caching=False)
    sp = lambda m: dspark.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
    if a.prefill: return prefill(a, llm, sp)
    prompt = list(range(100, 132))
    llm.generate([prompt], sp(8), use_tqdm=False)                  # compile
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate([prompt], sp(8 + a.steps), use_tqdm=False)
    torch.cuda.synchronize(); long = time.perf_counter() - t
    t = time.perf_counter(); llm.generate([prompt], sp(8), use_tqdm=False); torch.cuda.synchronize()
    step_ms = (long - (time.perf_counter() - t)) / a.steps * 1e3
    kernels = lambda m: by_kernel(lambda: llm.generate([prompt], sp(m), use_tqdm=False))   # one generate of `m` tokens
    base, run = kernels(1), kernels(1 + a.steps)          # the prefill and first token alone, then with the steps:
    n = a.steps                                           # their difference is the decode steps' own kernels
    rows = sorted(({"kernel": k[:120], "us_per_step": round((v[0] - base.get(k, (0, 0))[0]) / n, 1),
                    "calls_per_step": round((v[1] - base.get(k, (0, 0))[1]) / n, 1)} for k, v in run.items()),
                  key=lambda r: -r["us_per_step"])
    gpu_ms = sum(r["us_per_step"] for r in rows) / 1e3
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers, "graphs": a.graphs,
           "step_ms": round(step_ms, 3), "gpu_busy_ms_per_step": round(gpu_ms, 3),
           "launches_per_step": round(sum(r["calls_per_step"] for r in rows), 1), "top": rows[:40]}
    text = json.dumps(out, indent=1); print(text)
    Path(os.environ.get("OUT", "/tmp"), f"v4_flash_profile{'_graphs' if a.graphs else ''}.json").write_text(text + "\n")


def prefill(a, llm, sp) -> None:
    "`--prefill`: one prompt's kernels by name, their share of its time, and its wall time."
    g = torch.Generator().manual_seed(0)
    prompt = lambda: torch.randint(0, llm.model.cfg.vocab_size, (a.prefill,), generator=g).tolist()
    llm.generate([prompt()], sp(1), use_tqdm=False)                 # compile, allocate
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate([prompt()], sp(1), use_tqdm=False)
    torch.cuda.synchronize(); wall = time.perf_counter() - t
    by = by_kernel(lambda: llm.generate([prompt()], sp(1), use_tqdm=False))
    busy = sum(v[0] for v in by.values())
    rows = sorted(({"kernel": k[:120], "us": round(v[0], 1), "calls": v[1], "share": round(v[0] / busy, 4)}
                   for k, v in by.items()), key=lambda r: -r["us"])
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": a.layers, "prefill": a.prefill,
           "wall_ms": round(wall * 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2), "tok_s": round(a.prefill / wall, 1),
           "top": rows[:40]}
    text = json.dumps(out, indent=1); print(text[:4000])
    Path(os.environ.get("OUT", "/tmp"), "v4_flash_profile_prefill.json").write_text(text + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--graphs", action="store_true", help="the serving path: CUDA graphs")
    ap.add_argument("--prefill", type=int, default=0, help="profile one prefill of this many tokens instead")
    main(ap.parse_args())
