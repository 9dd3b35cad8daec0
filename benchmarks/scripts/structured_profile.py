"""Where a structured-outputs DSpark round spends its time on the embedded model (C1, T = 0, the JSON schema of
`structured_gpu.py`): cProfile of the host over a timed generate, the top functions by own time and by cumulative
time, beside the same generate without a schema.

    OUT=dir python benchmarks/scripts/structured_profile.py     # CUDA; writes $OUT/structured_profile.txt
"""
import cProfile, io, os, pstats, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
from dspark.tools.capacity_sweep import sweep_prompts

SCHEMA = __import__("ast").literal_eval(Path(__file__).with_name("structured_gpu.py").read_text().split("SCHEMA = ", 1)[1].split("\n\nap = ", 1)[0])
cuda = torch.cuda.is_available()
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
                 max_num_seqs=4, max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
prompts = sweep_prompts(DEFAULT_MODEL, 1, 128)
out = io.StringIO()
drafter = llm.engine.runner.proposer.drafter
kernel = drafter.masked_kernel                                  # the fast path's masked Markov kernel (None on a CPU)
for schema, masked_kernel in ((False, kernel), (True, None), (True, kernel), (False, kernel)):
    drafter.masked_kernel = masked_kernel
    sp = [SamplingParams(temperature=0.0, max_tokens=128, seed=0, structured_outputs={"json": SCHEMA} if schema else None)]
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
Path(os.environ.get("OUT", "/tmp"), "structured_profile.txt").write_text(text)
