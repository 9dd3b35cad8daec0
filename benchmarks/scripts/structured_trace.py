"""A GPU timeline of structured-outputs DSpark rounds at V4-Flash-0731 width (dummy weights, SIMULATED ACCEPTANCE
3.34, C1, T = 0, `v4_flash_decode.py`'s JSON schema), beside the same rounds without the schema: torch.profiler with
CUDA activity over one generate each. Writes each Chrome trace (gzipped) and a summary: GPU busy time a round (the
union of kernel intervals), and the GPU's idle gaps with the host calls that ran inside them.

    OUT=dir python benchmarks/scripts/structured_trace.py [--layers 4] [--tokens 64] [--concurrency 1 16] [--stack]
"""
import argparse, gzip, json, os, sys, time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dspark
from dspark.sample.sampling import SamplingParams
from v4_flash_decode import SCHEMA, overrides

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--tokens", type=int, default=64)
ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
ap.add_argument("--stack", action="store_true", help="also a trace of the schema generate with Python stacks")
a = ap.parse_args()
out = Path(os.environ.get("OUT", "/tmp"))
llm = dspark.LLM("deepseek-v4-flash-0731", load_format="dummy", quantization="auto",
                 hf_overrides=overrides("deepseek-v4-flash-0731", a.layers), device="cuda", dtype="bfloat16",
                 speculative="dspark", simulate_acceptance=3.34, max_model_len=4096, max_num_seqs=max(a.concurrency),
                 max_num_batched_tokens=1024, gpu_memory_utilization=0.9, enable_prefix_caching=False)
gen = torch.Generator().manual_seed(0)
every = [torch.randint(0, 4000, (32,), generator=gen).tolist() for _ in range(max(a.concurrency))]


def params(schema: bool, c: int) -> list:
    return [SamplingParams(temperature=0.0, max_tokens=a.tokens, seed=0, ignore_eos=True,
                           structured_outputs={"json": SCHEMA} if schema else None) for _ in range(c)]


def gaps(events: list[dict]) -> dict:
    "GPU busy union and idle gaps over a trace's kernel events, with the host's runtime calls inside each gap."
    kern = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                  key=lambda e: e["ts"])
    host = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cpu_op", "python_function")),
                  key=lambda e: e["ts"])
    if not kern: return {}
    busy, end, idle = 0.0, kern[0]["ts"], []
    for e in kern:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s > end:
            idle.append((s - end, end, s, e["name"][:60]))
        busy += max(0.0, f - max(s, end))
        end = max(end, f)
    span = end - kern[0]["ts"]
    idle.sort(reverse=True)
    top = []
    for dur, s, f, nxt in idle[:40]:
        inside = {}
        for h in host:
            if h["ts"] >= f: break
            if h["ts"] + h.get("dur", 0) > s and h["ts"] < f:
                inside[h["name"][:50]] = inside.get(h["name"][:50], 0.0) + min(f, h["ts"] + h["dur"]) - max(s, h["ts"])
        top.append({"us": round(dur, 1), "next_kernel": nxt,
                    "host": sorted(((round(v, 1), k) for k, v in inside.items()), reverse=True)[:8]})
    hist = {f">{b}us": round(sum(d for d, *_ in idle if d > b), 1) for b in (5, 20, 100, 500)}
    return {"span_us": round(span, 1), "busy_us": round(busy, 1), "idle_us": round(span - busy, 1),
            "idle_by_gap_size": hist, "kernels": len(kern), "top_gaps": top}


summary = {}
for c, schema in [(c, js) for c in a.concurrency for js in (False, True)]:
    prompts = every[:c]
    llm.generate(prompts, params(schema, c), use_tqdm=False)       # warm-up: graphs, grammar compile
    llm.generate(prompts, params(schema, c), use_tqdm=False)
    for stack in ((False, True) if (schema and a.stack and c == 1) else (False,)):
        before = llm.spec_stats()
        torch.cuda.synchronize()
        act = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=act, with_stack=stack) as prof:
            t0 = time.perf_counter()
            o = llm.generate(prompts, params(schema, c), use_tqdm=False)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        rounds = llm.spec_stats()["num_drafts"] - before["num_drafts"]
        name = f"trace_c{c}_schema{int(schema)}{'_stack' if stack else ''}"
        path = out / f"{name}.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
        with gzip.open(out / f"{name}.json.gz", "wt") as f: json.dump(events, f)
        path.unlink()
        g = gaps(events)
        summary[name] = {"wall_ms": round(wall * 1e3, 2), "tokens": len(o[0].outputs[0].token_ids), "rounds": rounds,
                         "ms_per_round_profiled": round(wall * 1e3 / max(rounds / c, 1), 3), **g}
        print(name, {k: v for k, v in summary[name].items() if k != "top_gaps"}, flush=True)
        for t in g.get("top_gaps", [])[:12]: print("  ", t, flush=True)
summary["gpu"] = torch.cuda.get_device_name()
(out / "structured_trace.json").write_text(json.dumps(summary, indent=1))
