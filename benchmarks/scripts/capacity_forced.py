"""Capacity control forced on (activation=2) against fixed K on one DSpark engine (default model, bf16, graphs, H200):
C16 and C64, 256 tokens a request, three repeats alternating; per run, which graphs served the steps (fused rounds,
token-count graphs, eager), the controller's counters, and a host profile of one forced C64 run. OUT=. python capacity_forced.py"""
import cProfile, io, json, os, pstats, statistics, time, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.spec.controller import CapacityConfig
from dspark.tools.capacity_sweep import sweep_prompts, capacity_attached, sweep_run
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
prompts = sweep_prompts(DEFAULT_MODEL, 64, 128)
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", capacity=CapacityConfig(activation=2), device="cuda", dtype="bfloat16",
                 max_num_seqs=64, max_num_batched_tokens=64 * 134, max_model_len=128 + 256 + 8, enable_prefix_caching=False,
                 kv_cache_memory_bytes=2 * 2**30)
res["summary"], res["knee"], res["policy"] = llm.graphs.summary(), llm.runner.capacity.activation, llm.runner.capacity.config.policy
g = llm.graphs
def counts(): return {"rounds": g.rounds.replays if g.rounds else 0, "graph": g.replays, "eager": g.eager_steps,
                      "draft": llm.runner.proposer.graphs.replays if llm.runner.proposer.graphs else 0}
sync = torch.cuda.synchronize
llm.generate(prompts[:2], dspark.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
for c in (16, 64):
    for rep in range(3):
        for mode in (("fixed", "capacity") if rep % 2 == 0 else ("capacity", "fixed")):
            c0 = counts()
            with capacity_attached(llm, mode == "capacity"):
                r = sweep_run(llm, mode, c, prompts, 0.0, 256, 0, sync)
            r["served"] = {k: v - c0[k] for k, v in counts().items()}
            r["depth"] = llm.runner.capacity.depth
            res["runs"].append(r)
            print(mode, c, round(r["tok_s"], 1), round(r["mean_acceptance_length"], 2), r["kept_drafts"], r["proposed_drafts"],
                  r["active_steps"], r["bypassed_steps"], r["served"], flush=True)
            json.dump(res, open(f"{OUT}/capacity_forced.json", "w"), indent=1)
res["summary_line"] = llm.runner.capacity.summary()
pr = cProfile.Profile()
with capacity_attached(llm, True):
    pr.enable(); sweep_run(llm, "capacity", 64, prompts, 0.0, 256, 0, sync); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); res["profile_capacity_c64"] = s.getvalue()[-7000:]
pr = cProfile.Profile()
with capacity_attached(llm, False):
    pr.enable(); sweep_run(llm, "fixed", 64, prompts, 0.0, 256, 0, sync); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); res["profile_fixed_c64"] = s.getvalue()[-7000:]
print(res["summary_line"]); print(res["profile_capacity_c64"][-4500:])
json.dump(res, open(f"{OUT}/capacity_forced.json", "w"), indent=1)
