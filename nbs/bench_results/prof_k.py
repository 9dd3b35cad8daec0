"Kernel-level split of one medium-preset decode graph replay (C1 and C16, the prof_k record in medium_fused.json), and the host split of a DSpark C1 step on the default model. Run on a GPU: OUT=. python prof_k.py"
import tempfile, time, json, os, io, cProfile, pstats, collections, torch, dspark
import torch._dynamo
from torch.profiler import profile, ProfilerActivity
from dspark.runtime.graphs import forward_static
OUT = os.environ["OUT"]; res = {}
def kernels(fn, reps=5):
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]; a[0] += 1; a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    rows = sorted(([k, c / reps, t / reps] for k, (c, t) in agg.items()), key=lambda r: -r[2])
    return {"kernels": sum(r[1] for r in rows), "gpu_us": sum(r[2] for r in rows), "top": [[k, round(c, 1), round(t, 1)] for k, c, t in rows[:45]]}
if os.environ.get("MED", "1") == "1":
    path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
    llm = dspark.LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512, kv_cache_memory_bytes=2**31)
    sp = dspark.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    llm.generate([list(range(2, 130))], sp, use_tqdm=False)
    g = llm.runner.forward
    for n in (1, 16):
        rg = g.graphs[n][0].replay
        res[f"medium_replay_{n}"] = kernels(rg)
        res[f"medium_eager_{n}"] = kernels(lambda: forward_static(g.model, g.cache, g.buf, n, g.taps, g.finals, g.mhc, g.context))
        print(n, json.dumps(res[f"medium_replay_{n}"])[:300], json.dumps(res[f"medium_eager_{n}"], indent=0)[:6000], flush=True)
    del llm; torch.cuda.empty_cache()
if os.environ.get("DS", "1") == "1":
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.tools.capacity_sweep import sweep_prompts
    prompts = sweep_prompts(DEFAULT_MODEL, 2, 128)
    for mode in ("none", "dspark"):
        llm = dspark.LLM(DEFAULT_MODEL, speculative=None if mode == "none" else mode, device="cuda", dtype="bfloat16",
                         max_num_seqs=16, max_model_len=512, kv_cache_memory_bytes=2**30)
        sp = dspark.SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        llm.generate(prompts[:1], sp, use_tqdm=False)
        t0 = time.perf_counter(); llm.generate(prompts[:1], sp, use_tqdm=False); wall = time.perf_counter() - t0
        g = llm.runner.forward
        res[f"default_{mode}"] = {"tok_s": round(128 / wall, 1), "replay1_ms": g.step_ms(1), "replay6_ms": g.step_ms(6) if 6 in g.graphs else g.step_ms(8)}
        dg = getattr(llm.runner.proposer, "graphs", None)
        if dg is not None: res[f"default_{mode}"]["draft_ms"] = dg.step_ms(1)
        res[f"default_{mode}"]["kern_verify"] = kernels(g.graphs[8 if mode == "dspark" else 1][0].replay)["kernels"]
        if dg is not None: res[f"default_{mode}"]["kern_draft"] = kernels(dg.graphs[1][0].replay)["kernels"]
        pr = cProfile.Profile(); pr.enable()
        llm.generate(prompts[:1], sp, use_tqdm=False); torch.cuda.synchronize(); pr.disable()
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(mode, s.getvalue()[:5000])
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); print(mode, s.getvalue()[:7000])
        print(mode, res[f"default_{mode}"], flush=True)
json.dump(res, open(OUT + "/prof_k.json", "w"), indent=1)
