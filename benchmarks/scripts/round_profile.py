"""Where a C1 step's time goes on the default model (bf16, graphs, H200): kernels per replay and their time for the
no-spec decode graph (1 token), the verify graph (6 tokens), the greedy draft graph and the fused DSpark round,
from torch.profiler over repeated replays; wall time per replay from CUDA events. OUT=. python round_profile.py"""
import json, os, collections, torch, dspark
from torch.profiler import profile, ProfilerActivity
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
prompt = sweep_prompts(DEFAULT_MODEL, 1, 128)
from round_profile_lib import ev_time, kernels
for mode in (None, "dspark"):
    llm = dspark.LLM(DEFAULT_MODEL, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16,
                     max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    g, out = llm.graphs, {}
    targets = {"decode_1": g.graphs[1][0].replay}
    if mode:
        targets["verify_6"] = g.graphs[next(s for s in g.sizes if s >= 6)][0].replay
        targets["draft_1"] = llm.runner.proposer.graphs.graphs[1][0].replay
        targets["round_1"] = g.rounds.graphs[1][0].replay
    for name, fn in targets.items():
        out[name] = {"wall_ms": round(ev_time(fn), 4), **kernels(fn)}
        print(mode, name, json.dumps(out[name])[:900], flush=True)
    res[mode or "none"] = out
    del llm; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/round_profile.json", "w"), indent=1)
