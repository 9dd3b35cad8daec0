"""Sampled decoding before and after the device sampler (chapter 16), on one H200, bf16, CUDA graphs.

Usage: `OUT=dir python nbs/bench_results/sampled.py PKG_DIR LABEL`, where PKG_DIR holds the `dspark` package to
time (the repository root for this version, an exported older tree for the one before). Default model: no-spec
and DSpark K=5 at concurrency 1, 4, 16, 64; medium preset (random weights, V = 32768): no-spec at 1 and 16. Each
cell: 128 tokens after a 128-token prompt per request, greedy and at T = 1 (request i seeded with i), timed after
a warm-up in the same engine. Writes $OUT/sampled_LABEL.json."""
import json, os, sys, tempfile, time
pkg, label = os.path.abspath(sys.argv[1]), sys.argv[2]
sys.path.insert(0, pkg)
import torch, dspark
assert dspark.__file__.startswith(pkg), dspark.__file__
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.model.checkpoint import make_tiny_checkpoint
from dspark.sample.sampling import SamplingParams

MODEL = os.path.abspath("dspark/models/default")
OUT = os.environ["OUT"]
res = {"label": label, "package": dspark.__file__, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
       "runs": []}

def timed(llm, ps, temp, n):
    sps = [SamplingParams(temperature=temp, max_tokens=n, seed=i, ignore_eos=True) for i in range(len(ps))]
    torch.cuda.synchronize(); t0 = time.perf_counter()
    outs = llm.generate(ps, sps, use_tqdm=False)
    torch.cuda.synchronize()
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)

def sweep(model, name, modes, concurrencies, prompts, seqs):
    for mode in modes:
        llm = dspark.LLM(model, speculative=None if mode == "none" else mode, device="cuda", dtype="bfloat16",
                         max_num_seqs=seqs, max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
        for c in concurrencies:
            for temp in (0.0, 1.0):
                timed(llm, prompts[:c], temp, 8)                        # warm-up
                before = llm.spec_stats()
                tok_s = timed(llm, prompts[:c], temp, 128)
                after = llm.spec_stats()
                d = after["num_drafts"] - before["num_drafts"]
                a = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                row = {"model": name, "mode": mode, "C": c, "T": temp, "tok_s": round(tok_s, 1),
                       "acceptance": round(1 + a / d, 3) if d else None}
                res["runs"].append(row); print(json.dumps(row), flush=True)
        del llm; torch.cuda.empty_cache()

sweep(MODEL, "default", ("none", "dspark"), (1, 4, 16, 64), sweep_prompts(MODEL, 64, 128), 64)
medium = make_tiny_checkpoint(tempfile.mkdtemp() + "/medium", preset="medium", seed=0, drafter=None)
g = torch.Generator().manual_seed(0)
sweep(medium, "medium", ("none",), (1, 16), torch.randint(2, 32768, (16, 128), generator=g).tolist(), 16)
json.dump(res, open(f"{OUT}/sampled_{label}.json", "w"), indent=1)
