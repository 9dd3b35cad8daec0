"Where a DSpark/none step's time goes at C1 and C16 on the default model (synchronised timers around the runner's parts)."
import time, json, os, torch, dspark
from collections import defaultdict
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
import dspark.engine.core as E
T = defaultdict(float)
def timed(obj, name, key):
    f = getattr(obj, name)
    def w(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter(); r = f(*a, **k); torch.cuda.synchronize(); T[key] += time.perf_counter() - t; return r
    setattr(obj, name, w)
prompts = sweep_prompts(DEFAULT_MODEL, 16, 128)
out = {}
for mode in ("none", "dspark"):
    for c in (1, 16):
        llm = dspark.LLM(DEFAULT_MODEL, speculative=None if mode == "none" else mode, device="cuda", dtype="bfloat16",
                         max_num_seqs=16, max_model_len=256, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        r = llm.runner; T.clear()
        timed(r, "forward", "forward"); timed(r, "_propose_all", "propose_all"); timed(r, "execute", "execute"); timed(llm, "step", "step")
        if r.proposer is not None: timed(r.proposer, "observe_many" if hasattr(r.proposer, "observe_many") else "observe", "observe")
        t0 = time.perf_counter()
        o = llm.generate(prompts[:c], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - t0
        n = sum(len(x.outputs[0].token_ids) for x in o)
        out[f"{mode}_c{c}"] = {"tok_s": round(n / wall, 1), "wall": round(wall, 3), **{k: round(v, 3) for k, v in T.items()},
                               "replays": llm.graphs.replays, "eager_steps": llm.graphs.eager_steps}
        print(mode, c, out[f"{mode}_c{c}"], flush=True)
json.dump(out, open(os.environ["OUT"] + "/split.json", "w"), indent=1)
