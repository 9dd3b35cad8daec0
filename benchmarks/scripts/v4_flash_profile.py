"""Where a C1 decode step's time goes at DeepSeek-V4-Flash width (all 256 experts, dummy weights as stored): the GPU
kernels of a few decode steps under torch.profiler, grouped by kernel name, per step (a run of the prefill and first token
alone is subtracted), beside the step's wall time.

    python benchmarks/scripts/v4_flash_profile.py [--layers 4] [--steps 16]     # writes $OUT/v4_flash_profile.json

With `--graphs` the steps replay their CUDA graphs (the serving path: fused mHC, one-launch norms) and the profiler
reports the kernels inside the replays; without it the eager step runs, kernel by kernel.
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


def main(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import dspark
    from torch.profiler import ProfilerActivity, profile
    llm = dspark.LLM(model="deepseek-v4-flash", load_format="dummy", quantization="auto",
                     hf_overrides={"num_hidden_layers": a.layers}, device="cuda", dtype="bfloat16", enforce_eager=not a.graphs,
                     max_model_len=4096, max_num_seqs=4, max_num_batched_tokens=1024, gpu_memory_utilization=0.92)
    sp = lambda m: dspark.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
    prompt = list(range(100, 132))
    llm.generate([prompt], sp(8), use_tqdm=False)                  # compile
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate([prompt], sp(8 + a.steps), use_tqdm=False)
    torch.cuda.synchronize(); long = time.perf_counter() - t
    t = time.perf_counter(); llm.generate([prompt], sp(8), use_tqdm=False); torch.cuda.synchronize()
    step_ms = (long - (time.perf_counter() - t)) / a.steps * 1e3
    def kernels(m: int) -> dict:
        "Device µs and launches by kernel name over one generate of `m` tokens (its prefill included)."
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], sp(m), use_tqdm=False)
            torch.cuda.synchronize()
        by = defaultdict(lambda: [0.0, 0])
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                by[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                by[e.name][1] += 1
        return by
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


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--graphs", action="store_true", help="the serving path: CUDA graphs")
    main(ap.parse_args())
