"""Which source line launches each kernel of a C1 decode step (H200, bf16): the captured step's function run eagerly
under torch.profiler with stacks, every kernel charged to the innermost dspark frame above it; for the default
model (no-spec decode, DSpark verify-6 and draft step) and the medium preset. OUT=. python op_sources.py"""
import collections, json, os, tempfile, torch, dspark
from torch.profiler import profile, ProfilerActivity
from dspark.checkpoint import DEFAULT_MODEL
from dspark.sampling import SamplingParams
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}

def frame(stack):
    for f in stack or []:
        if "/dspark/" in f and "graphs.py(4" not in f: return f.split("/dspark/")[-1][:90]
    return "?"

def sources(fn, reps=3):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(reps): fn()
        torch.cuda.synchronize()
    agg, total = collections.defaultdict(lambda: [0, 0.0]), [0, 0.0]
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU or not e.kernels: continue
        if any(c.kernels for c in e.cpu_children): continue      # charge kernels to the innermost op only
        a = agg[f"{e.name} @ {frame(e.stack)}"]
        for k in e.kernels: a[0] += 1; a[1] += k.duration; total[0] += 1; total[1] += k.duration
    top = sorted(agg.items(), key=lambda kv: -kv[1][0])
    return {"kernels": round(total[0] / reps, 1), "kernel_us": round(total[1] / reps, 1),
            "by_source": [[k, round(v[0] / reps, 1), round(v[1] / reps, 1)] for k, v in top[:60]]}

def llm_for(path, mode):
    llm = dspark.LLM(path, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                     kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    llm.generate([list(range(5, 133))], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return llm

medium = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
for name, path, mode in (("default_none", DEFAULT_MODEL, None), ("default_dspark", DEFAULT_MODEL, "dspark"),
                         ("medium_none", medium, None)):
    llm = llm_for(path, mode); g = llm.graphs
    def step(n):
        def run(): g._pad_only(n); g.run(n)
        return run
    out = {"decode_1": sources(step(1))}
    if mode:
        out["verify_6"] = sources(step(next(s for s in g.sizes if s >= 6)))
        dg = llm.runner.proposer.graphs
        pr = llm.runner.proposer
        out["draft_1"] = sources(lambda: pr.draft_tensors(dg.slots[:1], dg.anchors[:1], dg.P[:1], dg.K))
    res[name] = out
    for k, v in out.items():
        if v: print(name, k, v["kernels"], v["kernel_us"], json.dumps(v["by_source"][:40], indent=0), flush=True)
    del llm, g; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/op_sources.json", "w"), indent=1)
