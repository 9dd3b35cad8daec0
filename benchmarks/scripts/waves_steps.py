"""Per-step anatomy of a steady load (the bench's --waves 4) on the default model: each step synced and timed, and
what it ran (graphed decode step, eager step, fused DSpark round, draft graph) with how many requests were
prefilling — why DSpark falls behind no-spec at C16 and C64 under a steady load when it is ahead in a closed batch.
OUT=. [CONC="16 64"] [DEVICE=cuda] python waves_steps.py"""
import itertools, json, os, time, torch, dspark
from dspark.tools.bench import _default_model_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
OUT, DEV = os.environ["OUT"], os.environ.get("DEVICE", "cuda")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
res = {}
for C in (int(c) for c in os.environ.get("CONC", "16 64").split()):
    prompts = _default_model_prompts(DEFAULT_MODEL, 4 * C, 128)
    prompts = [prompts[i % len(prompts)] for i in range(4 * C)]      # the GPU machine's stdlib has fewer files
    for mode in ("none", "dspark"):
        llm = dspark.LLM(DEFAULT_MODEL, speculative=None if mode == "none" else mode, device=DEV,
                         dtype="bfloat16" if DEV == "cuda" else "float32", max_num_seqs=C,
                         max_num_batched_tokens=max(8192, 16 * C), max_model_len=128 + 128 + 13 + 8,
                         kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
        sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
        llm.generate(prompts[:C], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        g, pr = llm.graphs, llm.runner.proposer
        rd, dg = getattr(g, "rounds", None), getattr(pr, "graphs", None)
        cnt = lambda: (g.replays if g else 0, g.eager_steps if g else 0, rd.replays if rd else 0, dg.replays if dg else 0)
        todo = iter(prompts)
        ids = [llm.add_request(p, sp) for p in itertools.islice(todo, C)]
        steps, t0 = [], time.perf_counter()
        while llm.has_unfinished_requests():
            pre = sum(r.num_computed < len(r.prompt_ids) for r in llm.scheduler.running) + len(llm.scheduler.waiting)
            c0, s0 = cnt(), time.perf_counter()
            done = sum(d.finished for d in llm.step())
            sync()
            c1 = cnt()
            kinds = "+".join(k for k, a, b in zip(("graph", "eager", "round", "draftgraph"), c0, c1) if b > a) or "host"
            steps.append((round(1e3 * (time.perf_counter() - s0), 3), kinds, pre, len(llm.scheduler.running)))
            ids += [llm.add_request(p, sp) for p in itertools.islice(todo, done)]
        wall = time.perf_counter() - t0
        for i in ids: llm.pop_output(i)
        by = {}
        for ms, kinds, pre, _ in steps:
            key = f"{kinds}{' prefill' if pre else ''}"
            n, t = by.get(key, (0, 0.0)); by[key] = (n + 1, round(t + ms, 2))
        res[f"{mode}_C{C}"] = {"wall_s": round(wall, 3), "tok_s": round(4 * C * 128 / wall, 1), "steps": len(steps),
                               "by_kind": by, "spec": llm.spec_stats() if mode != "none" else None, "steps_list": steps}
        print(mode, C, json.dumps({k: v for k, v in res[f"{mode}_C{C}"].items() if k != "steps_list"}), flush=True)
        del llm
        if DEV == "cuda": torch.cuda.empty_cache()
        json.dump(res, open(f"{OUT}/waves_steps.json", "w"), indent=1)
