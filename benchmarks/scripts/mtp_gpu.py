"""MTP's captured drafting on the H200 (chapter 24): greedy tokens with graphs equal the eager engine's (the
embedded model's MTP layer, K = 1 and 3, bf16, four held-out prompts), then the bench's decode runs for no-spec and
MTP at 1, 16 and 64 requests (128 tokens after 128-token prompts). One run. OUT=. python mtp_gpu.py
As run, the held-out pool gave 23 prompts of 128 tokens, and this script does not wrap them as the bench does:
its "64" pair ran at 23 requests (mtp_gpu.json records the concurrency that ran)."""
import json, os, torch, dspark
from dspark.tools.bench import _default_model_prompts, decode_run
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
prompts = _default_model_prompts(DEFAULT_MODEL, 64, 128)
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
for K in (1, 3):
    kw = dict(speculative="mtp", num_speculative_tokens=K, device="cuda", dtype="bfloat16", max_num_seqs=4,
              kv_cache_memory_bytes=2**29, enable_prefix_caching=False)
    runs = {}
    for eager in (True, False):
        llm = dspark.LLM(DEFAULT_MODEL / "mtp", enforce_eager=eager, **kw)
        runs[eager] = ([o.outputs[0].token_ids for o in llm.generate(prompts[:4], sp, use_tqdm=False)], llm.spec_stats())
        if not eager: replays = llm.runner.proposer.graphs.replays
    res[f"K{K}"] = {"identical": runs[True][0] == runs[False][0], "mtp_graph_replays": replays,
                    "acceptance_eager": runs[True][1]["mean_acceptance_length"],
                    "acceptance_graphs": runs[False][1]["mean_acceptance_length"]}
    print(K, json.dumps(res[f"K{K}"]), flush=True)
res["decode"] = []
for c in (1, 16, 64):
    for mode in (None, "mtp"):
        r = decode_run(DEFAULT_MODEL / "mtp" if mode else DEFAULT_MODEL, prompts[:c], mode, 1 if mode else None, 128,
                       "cuda", "bfloat16")
        res["decode"].append({k: v for k, v in r.items() if k != "token_ids"})
        print(json.dumps(res["decode"][-1]), flush=True)
        json.dump(res, open(os.environ["OUT"] + "/mtp_gpu.json", "w"), indent=1)
