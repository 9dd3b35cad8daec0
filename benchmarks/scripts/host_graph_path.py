"""The engine's host work per decode step on the CUDA-graph path, apart from the GPU (analysis, CPU): a tiny
checkpoint with the real `GraphRunner` (buffers, staging, layout) whose graphs are replaced by no-op replays of
outputs computed once, so a decode step is exactly the host's share. Prefill runs eagerly and is not timed.
Median decode step time and the share of each engine part, at 64 and 256 greedy requests (128 tokens after 16-token prompts).
python host_graph_path.py [--profile]  (writes host_graph_path.json beside it)"""
import collections, cProfile, json, platform, pstats, statistics, sys, tempfile, time, torch, dspark
from pathlib import Path
from dspark import LLM, SamplingParams
from dspark.runtime.graphs import GraphRunner

class NoGraph:
    "A replay that does nothing: the outputs it 'writes' were computed once, eagerly."
    def replay(self): pass

def host_engine(ck, R):
    llm = LLM(ck, max_num_seqs=R, max_num_batched_tokens=8192, kv_cache_memory_bytes=2**28, enable_prefix_caching=False)
    rn = llm.runner
    g = GraphRunner(rn.model, rn.cache, rn.forward, R, rn.cache.cc.lookahead, rn.max_model_len, capture=False)
    with torch.no_grad(): g.graphs = {n: (NoGraph(), g.run(n)) for n in g.sizes}
    rn.forward = g
    return llm

def main(profile=False):
    ck = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="tiny", seed=0, drafter=None)
    res = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "runs": []}
    for R in (64, 256):
        llm = host_engine(ck, R)
        T = collections.defaultdict(list)
        def timed(obj, name):
            f = getattr(obj, name)
            def w(*a, **k):
                t = time.perf_counter(); r = f(*a, **k); T[name].append(time.perf_counter() - t); return r
            setattr(obj, name, w)
        for o, n in ((llm.scheduler, "schedule"), (llm.runner, "execute"), (llm.scheduler, "update"), (llm, "step")):
            timed(o, n)
        pool = torch.randint(2, 500, (R, 16), generator=torch.Generator().manual_seed(0)).tolist()
        sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
        llm.generate(pool, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False); T.clear()
        pr = cProfile.Profile() if profile else None
        if pr: pr.enable()
        llm.generate(pool, sp, use_tqdm=False)
        if pr: pr.disable(); pstats.Stats(pr).sort_stats("cumtime").print_stats(45)
        dec = slice(len(T["step"]) // 4, None)               # decode steps only: the prefill steps come first
        med = {k: round(statistics.median(v[dec]) * 1e3, 3) for k, v in T.items()}
        run = {"requests": R, "step_ms": med.pop("step"), "us_per_request": round(statistics.median(T["step"][dec]) / R * 1e6, 1),
               "parts_ms": med, "graph_replays": llm.runner.forward.replays}
        print(json.dumps(run)); res["runs"].append(run)
    if not profile: Path(__file__).with_suffix(".json").write_text(json.dumps(res, indent=1))

if __name__ == "__main__": main("--profile" in sys.argv)
