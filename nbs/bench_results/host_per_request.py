"""The engine's host work per decode step, apart from the model: a tiny checkpoint on the CPU with the runner's
forward replaced by views of a zero buffer eight columns wide (analysis only: every other part is the engine's
own; with the full vocabulary, the CPU's own cat and argmax of the fake logits were most of `execute`), 128 greedy
steps at 64 and 256 requests, timed per part (scheduler, execute, update, detokenising and stop checks).
python host_per_request.py  (writes host_per_request.json beside it)"""
import collections, json, platform, tempfile, time, torch, dspark
from pathlib import Path
from dspark import LLM, SamplingParams
ck = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="tiny", seed=0, drafter=None)
res = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "runs": []}
for R in (64, 256):
    llm = LLM(ck, max_num_seqs=R, max_num_batched_tokens=8192, kv_cache_memory_bytes=2**28, enable_prefix_caching=False)
    z = torch.zeros(8192, 8)            # greedy picks token 0 of 8: a valid id
    llm.runner.forward = lambda model, cache, chunks, seqs, *a, **k: list(
        z[:sum(c.shape[0] for c in chunks)].split([c.shape[0] for c in chunks]))
    T = collections.Counter()
    def timed(obj, name):
        f = getattr(obj, name)
        def w(*a, **k):
            t = time.perf_counter(); r = f(*a, **k); T[name] += time.perf_counter() - t; return r
        setattr(obj, name, w)
    for o, n in ((llm.scheduler, "schedule"), (llm.runner, "execute"), (llm.scheduler, "update"), (llm, "_advance")):
        timed(o, n)
    pool = torch.randint(2, 500, (R, 64), generator=torch.Generator().manual_seed(0)).tolist()
    sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(pool, sp, use_tqdm=False); T.clear()
    t = time.perf_counter(); llm.generate(pool, sp, use_tqdm=False); wall = time.perf_counter() - t
    run = {"requests": R, "host_ms_per_step": round(wall / 128 * 1e3, 3), "us_per_request": round(wall / 128 / R * 1e6, 1),
           "parts_ms_per_step": {k: round(v / 128 * 1e3, 3) for k, v in T.items()}}
    print(json.dumps(run)); res["runs"].append(run)
Path(__file__).with_suffix(".json").write_text(json.dumps(res, indent=1))
