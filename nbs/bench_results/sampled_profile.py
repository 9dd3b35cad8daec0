"""Where a sampled step's time goes (default model, bf16, graphs, C1, T = 1): cProfile of 60 engine steps for
no-spec and DSpark, top entries by cumulative time, plus per-step wall time. Prints only."""
import cProfile, io, os, pstats, sys, time
import torch, dspark
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
MODEL = os.path.abspath("dspark/models/default")
prompts = sweep_prompts(MODEL, 4, 128)
for mode in ("none", "dspark"):
    llm = dspark.LLM(MODEL, speculative=None if mode == "none" else mode, device="cuda", dtype="bfloat16",
                     max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    for temp in (0.0, 1.0):
        llm.generate(prompts[:1], SamplingParams(temperature=temp, max_tokens=16, seed=1, ignore_eos=True), use_tqdm=False)
        llm.add_request(prompts[1], SamplingParams(temperature=temp, max_tokens=400, seed=2, ignore_eos=True), request_id="p")
        llm.step(); llm.step(); torch.cuda.synchronize()
        pr = cProfile.Profile()
        t0 = time.perf_counter()
        pr.enable()
        for _ in range(60): llm.step()
        torch.cuda.synchronize()
        pr.disable()
        dt = (time.perf_counter() - t0) / 60
        print(f"\n===== {mode} T={temp}: {1e3 * dt:.2f} ms per step (under cProfile)")
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(28); print(s.getvalue()[-6000:])
        llm.abort_request("p")
        while llm.has_unfinished_requests(): llm.step()
    del llm; torch.cuda.empty_cache()
