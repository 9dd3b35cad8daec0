"Where a C1 prefill step and a C1 decode step spend their time (default model, none and DSpark; medium, none). OUT=. python prefill_profile.py"
import tempfile, time, json, os, io, cProfile, pstats, collections, statistics, torch, dspark
from torch.profiler import profile, ProfilerActivity
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
OUT = os.environ["OUT"]; res = {}
def gpu(fn):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn(); torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0]); n = 0; busy = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:70]]; a[0] += 1; a[1] += e.device_time_total; n += 1; busy += e.device_time_total
    syncs = sum(1 for e in prof.events() if e.name in ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::nonzero"))
    top = sorted(([k, c, round(t, 1)] for k, (c, t) in agg.items()), key=lambda r: -r[2])[:20]
    return {"kernels": n, "kernel_us": round(busy, 1), "syncish_ops": syncs, "top": top}
def prof_host(fn, k=40):
    pr = cProfile.Profile(); pr.enable(); fn(); torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(k); return s.getvalue()
prompts = sweep_prompts(DEFAULT_MODEL, 8, 128)
def cases(path, mode, tag, prompts):
    llm = dspark.LLM(path, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                     kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    sp = dspark.SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)
    def prefill(i):
        llm.add_request(prompts[i], sp, request_id=f"p{i}"); torch.cuda.synchronize()
        t = time.perf_counter(); llm.step(); torch.cuda.synchronize(); return time.perf_counter() - t
    def finish(i):
        while llm.has_unfinished_requests(): llm.step()
        llm.pop_output(f"p{i}")
    ts = []
    for i in range(2, 6): ts.append(prefill(i)); finish(i)
    r = {"prefill_ms_median": round(1e3 * statistics.median(ts), 2), "prefill_ms": [round(1e3 * t, 2) for t in ts]}
    llm.add_request(prompts[6], sp, request_id="p6"); r["prefill_gpu"] = gpu(llm.step); finish(6)
    llm.add_request(prompts[7], sp, request_id="p7"); host = prof_host(llm.step)
    llm.step(); llm.step()
    ds = []
    for _ in range(6):
        torch.cuda.synchronize(); t = time.perf_counter(); llm.step(); torch.cuda.synchronize(); ds.append(time.perf_counter() - t)
    r["decode_step_ms_median"] = round(1e3 * statistics.median(ds), 3)
    r["decode_gpu"] = gpu(llm.step)
    dhost = prof_host(llm.step, 30)
    finish(7)
    g = llm.runner.forward
    r["replay1_ms"] = round(g.step_ms(1), 3)
    if 6 in g.graphs: r["replay6_ms"] = round(g.step_ms(6), 3)
    dg = getattr(llm.runner.proposer, "graphs", None) if llm.runner.proposer else None
    if dg is not None: r["draft1_ms"] = round(dg.step_ms(1), 3)
    print(tag, json.dumps(r, indent=0)[:4000], flush=True)
    print(tag, "PREFILL HOST\n", host[:6000], flush=True)
    print(tag, "DECODE HOST\n", dhost[:3500], flush=True)
    res[tag] = r
    del llm; torch.cuda.empty_cache()
cases(DEFAULT_MODEL, None, "default_none", prompts)
cases(DEFAULT_MODEL, "dspark", "default_dspark", prompts)
if os.environ.get("MED", "1") == "1":
    path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
    g = torch.Generator().manual_seed(0)
    cases(path, None, "medium_none", [torch.randint(2, 32768, (128,), generator=g).tolist() for _ in range(8)])
json.dump(res, open(OUT + "/prefill_profile.json", "w"), indent=1)
