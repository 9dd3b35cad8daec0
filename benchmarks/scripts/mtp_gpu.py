"""MTP on the GPU (chapters 23-24): greedy tokens with graphs (fused rounds: verify, accept and draft in one replay,
launched ahead) equal the eager engine's (the embedded model's MTP layer, K = 1 and 3, bf16, four held-out prompts);
then the bench's decode runs for no-spec, MTP at K = 1, 2 and 3, and DSpark at 1, 4, 16 and 64 requests (128 tokens after
128-token prompts; the held-out pool is wrapped to 64 as the bench does), no drafting again last at each
concurrency (`tok_s_repeat`: the run's A/A spread). One run.

    OUT=. python benchmarks/scripts/mtp_gpu.py            # H100/H200, about 5 minutes; $OUT/mtp_gpu.json
    OUT=. python benchmarks/scripts/mtp_gpu.py --concurrency 1 16 64 --ks 1 2    # a shorter run
"""
import argparse, json, os, torch, dspark
from dspark.tools.bench import _default_model_prompts, decode_run
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="MTP's speculative tokens in the decode runs")
a = ap.parse_args()
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
from dspark.kernels.mtp import mtp_kernels_check
res["mtp_kernels_check"] = mtp_kernels_check(dspark.LLM(DEFAULT_MODEL / "mtp", speculative="mtp", device="cuda", dtype="bfloat16",
                                                         max_num_seqs=4, kv_cache_memory_bytes=2**28).engine.runner.proposer.mtp)
print("mtp_kernels_check:", res["mtp_kernels_check"], flush=True)
pool = _default_model_prompts(DEFAULT_MODEL, 64, 128)
prompts = (pool * (64 // len(pool) + 1))[:64]
save = lambda: json.dump(res, open(os.environ.get("OUT", "/tmp") + "/mtp_gpu.json", "w"), indent=1)
sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
for K in (1, 3):
    kw = dict(speculative="mtp", num_speculative_tokens=K, device="cuda", dtype="bfloat16", max_num_seqs=4,
              kv_cache_memory_bytes=2**29, enable_prefix_caching=False)
    runs = {}
    for eager in (True, False):
        llm = dspark.LLM(DEFAULT_MODEL / "mtp", enforce_eager=eager, **kw)
        runs[eager] = ([o.outputs[0].token_ids for o in llm.generate(prompts[:4], sp, use_tqdm=False)], llm.spec_stats())
        if not eager: rounds = llm.graphs.rounds
    res[f"K{K}"] = {"identical": runs[True][0] == runs[False][0], "fused_rounds": rounds is not None,
                    "round_replays": rounds.replays if rounds else 0,
                    "acceptance_eager": runs[True][1]["mean_acceptance_length"],
                    "acceptance_graphs": runs[False][1]["mean_acceptance_length"]}
    print(K, json.dumps(res[f"K{K}"]), flush=True)
    save()
res["decode"] = []
for c in a.concurrency:
    for mode, k in ((None, None), *(("mtp", k) for k in a.ks), ("dspark", None)):
        path = DEFAULT_MODEL / "mtp" if mode == "mtp" else DEFAULT_MODEL
        try: r = decode_run(path, prompts[:c], mode, k, 128, "cuda", "bfloat16")
        except Exception as e: r = {"mode": mode, "k": k, "concurrency": c, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        res["decode"].append({key: v for key, v in r.items() if key != "token_ids"})
        print(json.dumps({key: r.get(key) for key in ("mode", "k", "concurrency", "tok_s", "decode_step_ms",
                                                      "mean_acceptance_length", "rounds_ahead_used", "error")}), flush=True)
        save()
    base = next(r for r in res["decode"] if r["concurrency"] == c and r["mode"] in (None, "none"))
    if "error" not in base:          # no-spec again after the others: its spread says whether the machine stayed quiet
        again = decode_run(DEFAULT_MODEL, prompts[:c], None, None, 128, "cuda", "bfloat16")
        base["tok_s_repeat"], base["decode_step_ms_repeat"] = again["tok_s"], again["decode_step_ms"]
        print(json.dumps({"mode": None, "concurrency": c, "repeat_tok_s": again["tok_s"]}), flush=True)
        save()
