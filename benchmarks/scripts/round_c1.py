"Fused DSpark rounds on the default model (bf16, graphs): replay times and C1 tok/s with and without rounds, one run."
import time, json, os, io, cProfile, pstats, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
from dspark.tools.records import split_raw, write_record
prompts = sweep_prompts(DEFAULT_MODEL, 4, 128)
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
def ev_time(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize(); a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / n
sp = SamplingParams(temperature=0, max_tokens=96, ignore_eos=True)
def tok_s(llm, reps=5):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); llm.generate(prompts[:1], sp, use_tqdm=False); ts.append(96 / (time.perf_counter() - t0))
    return sorted(ts)[len(ts) // 2], [round(t, 1) for t in ts]
for mode in ("none", "dspark"):
    t0 = time.perf_counter()
    llm = dspark.LLM(DEFAULT_MODEL, speculative=None if mode == "none" else mode, device="cuda", dtype="bfloat16",
                     max_num_seqs=16, max_model_len=256, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    r = res[mode] = {"init_s": round(time.perf_counter() - t0, 1), "summary": llm.graphs.summary()}
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    g = llm.graphs
    r.update({f"replay_ms_{n}": round(ev_time(g.graphs[n][0].replay), 4) for n in (1, 8) if n in g.graphs})
    if mode == "dspark":
        r["draft_replay_ms_1"] = round(ev_time(llm.runner.proposer.graphs.graphs[1][0].replay), 4)
        r["round_replay_ms_1"] = round(ev_time(g.rounds.graphs[1][0].replay), 4)
        r["round_replay_ms_4"] = round(ev_time(g.rounds.graphs[4][0].replay), 4)
        rounds = g.rounds
        g.rounds = None
        r["tok_s_two_graphs"], r["tok_s_two_graphs_all"] = tok_s(llm)
        r["spec_two"] = llm.spec_stats()
        g.rounds = rounds
        o2 = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    if mode == "dspark":
        waits, settle = [], llm.runner.settle
        def timed():
            t = time.perf_counter(); settle(); waits.append(time.perf_counter() - t)
        llm.runner.settle = timed
        t0 = time.perf_counter(); llm.generate(prompts[:1], sp, use_tqdm=False); wall = time.perf_counter() - t0
        r["settle_ms_total"], r["generate_ms"], r["steps"] = round(1e3 * sum(waits), 2), round(1e3 * wall, 2), len(waits)
        llm.runner.settle = settle
    r0 = getattr(g.rounds, "replays", 0)
    r["tok_s"], r["tok_s_all"] = tok_s(llm)
    r["round_replays"] = getattr(g.rounds, "replays", 0) - r0
    if mode == "dspark":
        o1 = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        g.rounds = None; o3 = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]; g.rounds = rounds
        r["rounds_equal_two_graphs_tokens"] = o1 == o3
        r["spec"] = llm.spec_stats()
    pr = cProfile.Profile(); pr.enable()
    llm.generate(prompts[:1], sp, use_tqdm=False); torch.cuda.synchronize(); pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(mode, "HOST tottime\n", s.getvalue()[-4000:])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts[:1], sp, use_tqdm=False); torch.cuda.synchronize()
    ev = list(prof.key_averages()); ev.sort(key=lambda e: -e.device_time_total)
    r["gpu_ms_per_generate"] = round(sum(e.device_time_total for e in ev) / 1e3, 2)
    r["gpu_top"] = [(e.key[:50], e.count, round(e.device_time_total / 1e3, 3)) for e in ev[:12]]
    print(mode, json.dumps(r)[:3000], flush=True)
    write_record("round_c1", command="python benchmarks/scripts/round_c1.py", folder=os.environ.get("OUT"), **split_raw(res))
    del llm; torch.cuda.empty_cache()
