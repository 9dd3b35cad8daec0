"""Where a steady load's time goes, step by step, for no-spec and fixed-K DSpark (the capacity sweep's engines and
load: WAVES x C requests of TOKENS tokens, at most C in flight, new prompts sent in the step one finishes). Steps are
not synced (the engine's own overlap stays on): each step's host wall time, the requests running and prefilling
before it, and which graphs it replayed. Steps fall in three classes: `admit` (some request prefilling), `full`
(C requests decoding) and `tail` (fewer: the queue is empty). OUT=. [CONC=64] [WAVES=4] [TOKENS=128] [DEVICE=cuda] python steady_anatomy.py"""
import itertools, json, os, time, torch
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.engine.core import frozen_heap
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams
OUT, DEV = os.environ["OUT"], os.environ.get("DEVICE", "cuda")
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
C, WAVES, TOKENS, PL, K = int(os.environ.get("CONC", 64)), int(os.environ.get("WAVES", 4)), int(os.environ.get("TOKENS", 128)), 128, 5
prompts = sweep_prompts(DEFAULT_MODEL, C * WAVES, PL)
build = lambda spec: LLM(DEFAULT_MODEL, speculative=spec, num_speculative_tokens=K if spec else None, device=DEV,
                         dtype="bfloat16" if DEV == "cuda" else "float32", seed=0, max_num_seqs=C, max_num_batched_tokens=max(1024, C * (PL + K + 1)),
                         max_model_len=PL + TOKENS + K + 2, enable_prefix_caching=False, kv_cache_memory_bytes=2 * 2**30)

def run(llm):
    g = llm.graphs
    rd, dg = getattr(g, "rounds", None), getattr(llm.runner.proposer, "graphs", None)
    cnt = lambda: (g.replays if g else 0, g.eager_steps if g else 0, rd.replays if rd else 0, dg.replays if dg else 0)
    sps = [SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, seed=i) for i in range(C * WAVES)]
    todo = iter(zip(prompts, sps))
    sync(); t0 = time.perf_counter()
    ids = [llm.add_request(p, sp) for p, sp in itertools.islice(todo, C)]
    steps = []
    while llm.has_unfinished_requests():
        R = len(llm.scheduler.running) + len(llm.scheduler.waiting)
        pre = sum(r.num_computed < len(r.prompt_ids) for r in llm.scheduler.running) + len(llm.scheduler.waiting)
        c0, s0 = cnt(), time.perf_counter()
        done = sum(d.finished for d in llm.step())
        ms = 1e3 * (time.perf_counter() - s0)
        kinds = "+".join(k for k, a, b in zip(("graph", "eager", "round", "draftgraph"), c0, cnt()) if b > a) or "host"
        steps.append((round(ms, 3), kinds, pre, R))
        ids += [llm.add_request(p, sp) for p, sp in itertools.islice(todo, done)]
    sync(); wall = time.perf_counter() - t0
    tokens = sum(len(llm.pop_output(i).outputs[0].token_ids) for i in ids)
    cls = {}
    for ms, kinds, pre, R in steps:
        key = "admit" if pre else ("full" if R >= C else "tail")
        n, t, rs = cls.get(key, (0, 0.0, 0)); cls[key] = (n + 1, round(t + ms, 2), rs + R)
    by = {}
    for ms, kinds, pre, R in steps:
        key = f"{kinds}{' admit' if pre else ''}"
        n, t = by.get(key, (0, 0.0)); by[key] = (n + 1, round(t + ms, 2))
    return dict(wall_s=round(wall, 4), tok_s=round(tokens / wall, 1), steps=len(steps),
                classes={k: dict(steps=n, ms=t, mean_requests=round(rs / n, 1)) for k, (n, t, rs) in cls.items()},
                by_kind=by, steps_list=steps)

res = {"gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu", "C": C, "waves": WAVES, "tokens": TOKENS}
engines = {"none": build(None), "fixed": build("dspark")}
for llm in engines.values():
    llm.generate(prompts[:C], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
for rep in range(2):
    for mode in (("none", "fixed") if rep == 0 else ("fixed", "none")):
        with frozen_heap(): r = run(engines[mode])
        res[f"{mode}_{rep}"] = r
        print(mode, rep, json.dumps({k: v for k, v in r.items() if k != "steps_list"}), flush=True)
        json.dump(res, open(f"{OUT}/{os.environ.get('NAME', 'steady_anatomy')}.json", "w"), indent=1)
