"""Where an MTP round's time goes on the default model (bf16, graphs): wall time per replay (CUDA events) of the
no-spec decode graph and the fused MTP (K = 1, 3) and DSpark rounds at 1 and 16 requests; kernels per replay and
their time from torch.profiler; and the MTP drafting alone (`MTPGraphs.run`, eager) kernel by kernel.
OUT=. python mtp_profile.py"""
import json, os, sys, traceback, torch, dspark
sys.path.insert(0, os.path.dirname(__file__))
from round_profile_lib import ev_time, kernels
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
OUT = os.environ.get("OUT", "/tmp"); res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
prompt = sweep_prompts(DEFAULT_MODEL, 1, 128)
save = lambda: json.dump(res, open(f"{OUT}/mtp_profile.json", "w"), indent=1)
def probe(name, fn, prof=True):
    try:
        out = {"wall_ms": round(ev_time(fn), 4)}
        print(name, out, flush=True)
        if prof: out.update(kernels(fn, top=70))
    except Exception as e:
        traceback.print_exc(); out = {"error": f"{type(e).__name__}: {e}"[:400]}
    res[name] = out; save()
    print(name, json.dumps(out)[:2500], flush=True)
for mode, K in ((None, None), ("mtp", 1), ("mtp", 3), ("dspark", None)):
    path = DEFAULT_MODEL / "mtp" if mode == "mtp" else DEFAULT_MODEL
    kw = {"num_speculative_tokens": K} if K else {}
    llm = dspark.LLM(path, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                     kv_cache_memory_bytes=2**30, enable_prefix_caching=False, **kw)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    g = llm.graphs
    print(mode, K, "rounds:", getattr(g, "rounds", None), flush=True)
    for b in (1, 16):
        probe(f"{mode}_{K}_decode_{b}", g.graphs[b][0].replay, prof=mode is None)
        if mode: probe(f"{mode}_{K}_round_{b}", g.rounds.graphs[b][0].replay)
    if mode == "mtp":
        from dspark.runtime.mtp_graphs import MTPGraphs
        mg = MTPGraphs(llm.runner.proposer, 16, capture=False)
        probe(f"mtp_{K}_drafting_eager_1", lambda: mg.run(1))
    del llm; torch.cuda.empty_cache()
