"""Where a structured-outputs DSpark round spends its time on the embedded model (C1, T = 0, the JSON schema of
`structured_gpu.py`): cProfile of the host over a timed generate, the top functions by own time and by cumulative
time, beside the same generate without a schema.

    OUT=dir python benchmarks/scripts/structured_profile.py     # CUDA; writes $OUT/structured_profile.txt
    OUT=dir python benchmarks/scripts/structured_profile.py --v4 4   # V4-Flash-0731 width, 4 layers, dummy weights,
        # simulated acceptance 3.34 (labelled), v4_flash_decode.py's schema: $OUT/structured_profile_v4.txt
"""
import cProfile, io, os, pstats, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
from dspark.tools.capacity_sweep import sweep_prompts

import argparse
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--v4", type=int, default=0, help="layers of V4-Flash-0731 width (dummy weights); 0: the embedded model")
ap.add_argument("--tokens", type=int, default=128)
a = ap.parse_args()
SCHEMA = __import__("ast").literal_eval(Path(__file__).with_name("structured_gpu.py").read_text().split("SCHEMA = ", 1)[1].split("\n\nap = ", 1)[0])
cuda = torch.cuda.is_available()
dev, dt = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
if a.v4:                                                        # real width: dummy weights, simulated acceptance
    from v4_flash_decode import SCHEMA, overrides
    llm = dspark.LLM("deepseek-v4-flash-0731", load_format="dummy", quantization="auto", hf_overrides=overrides("deepseek-v4-flash-0731", a.v4),
                     device=dev, dtype=dt, speculative="dspark", simulate_acceptance=3.34, max_model_len=4096, max_num_seqs=4,
                     max_num_batched_tokens=1024, gpu_memory_utilization=0.9, enable_prefix_caching=False)
    prompts = [torch.randint(0, 4000, (32,), generator=torch.Generator().manual_seed(0)).tolist()]
else:
    llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device=dev, dtype=dt,
                     max_num_seqs=4, max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    prompts = sweep_prompts(DEFAULT_MODEL, 1, 128)
out = io.StringIO()
drafter = llm.engine.runner.proposer.drafter
kernel = drafter.masked_kernel                                  # the fast path's masked Markov kernel (None on a CPU)
for schema, masked_kernel in ((False, kernel), (True, None), (True, kernel), (False, kernel)):
    drafter.masked_kernel = masked_kernel
    sp = [SamplingParams(temperature=0.0, max_tokens=a.tokens, seed=0, ignore_eos=bool(a.v4), structured_outputs={"json": SCHEMA} if schema else None)]
    llm.generate(prompts, sp, use_tqdm=False)                  # warm-up
    before = llm.spec_stats()
    prof = cProfile.Profile()
    t0 = time.perf_counter(); prof.enable()
    o = llm.generate(prompts, sp, use_tqdm=False)
    prof.disable(); wall = time.perf_counter() - t0
    after = llm.spec_stats()
    d = after["num_drafts"] - before["num_drafts"]
    n = len(o[0].outputs[0].token_ids)
    print(f"schema={schema} masked kernel={masked_kernel is not None}: {n} tokens in {wall * 1e3:.1f} ms, {d} rounds, {wall / max(d, 1) * 1e6:.0f} us a round", file=out)
    s = pstats.Stats(prof, stream=out)
    s.sort_stats("tottime").print_stats(25)
    s.sort_stats("cumulative").print_stats(40)
text = out.getvalue()
print(text[:3000])
Path(os.environ.get("OUT", "/tmp"), "structured_profile_v4.txt" if a.v4 else "structured_profile.txt").write_text(text)
