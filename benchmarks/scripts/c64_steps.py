"Per-step anatomy of the bench's C64 run (default model, bf16): why DSpark loses to no-spec there."
import json, os, time, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
from dspark.tools.bench import decode_run
OUT = os.environ["OUT"]
prompts = sweep_prompts(DEFAULT_MODEL, 64, 128)
res = {}
for mode in ("none", "dspark"):
    k = 5 if mode == "dspark" else None
    llm = dspark.LLM(DEFAULT_MODEL, speculative=None if mode == "none" else mode, num_speculative_tokens=k, device="cuda",
                     dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=128 + 96 + 13 + 8,
                     kv_cache_memory_bytes=4 * 2**30)
    sp = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    for rep in range(2):
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        g = llm.graphs; rd = g.rounds; dg = getattr(llm.runner.proposer, "graphs", None)
        cnt = lambda: (g.replays, g.eager_steps, rd.replays if rd else 0, dg.replays if dg else 0)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for p in prompts: llm.add_request(p, sp)
        steps = []
        while llm.has_unfinished_requests():
            c0 = cnt(); s0 = time.perf_counter()
            batch_tokens = None
            llm.step(); torch.cuda.synchronize()
            c1 = cnt()
            kind = ["graph", "eager", "round", "draftgraph"]
            steps.append((round(1e3 * (time.perf_counter() - s0), 2), [kind[i] for i in range(4) if c1[i] > c0[i]],
                          len(llm.scheduler.running), len(llm.scheduler.waiting)))
        wall = time.perf_counter() - t0
        for rid in list(llm._tracks): llm.pop_output(rid)
        tot = {}
        for ms, kinds, *_ in steps:
            key = "+".join(kinds) or "none"
            tot.setdefault(key, [0, 0.0]); tot[key][0] += 1; tot[key][1] += ms
        res[f"{mode}_rep{rep}"] = {"wall_s": round(wall, 3), "tok_s": round(64 * 96 / wall, 1), "steps": len(steps),
                                   "by_kind": {k2: [n, round(t, 1)] for k2, (n, t) in tot.items()}, "first_steps": steps[:14]}
        print(mode, rep, json.dumps(res[f"{mode}_rep{rep}"]), flush=True)
    del llm; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/c64_steps.json", "w"), indent=1)
