"""Where a speculative round's time goes on the host: the engine's methods timed inclusively (perf_counter around
each, by class and name; CUDA graph replays by the function that replays them), per engine step, for no-spec, DSpark
and MTP rows and, with `--schema`, the same rows under a JSON schema; `--gpu-busy` adds a profiled run of each row
for its kernel time a step and the device's idle gaps between kernels (the profiler slows the host: read those gaps
as where, not how much). The chain `take_to_launch` is a constrained round's serial part: from the verify's result
reaching the host to the next verify's launch.

    OUT=. python benchmarks/scripts/host_phases.py --model dspark/models/default --modes none dspark mtp --concurrency 1 16
    OUT=. python benchmarks/scripts/host_phases.py --modes dspark --schema --layers 4      # V4-Flash 0731 width, dummy
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

T = defaultdict(float); N = defaultdict(int); MARK: dict[str, float] = {}; CHAIN = defaultdict(list)


def wrap(owner, name: str, label: str | None = None, after=None) -> None:
    "Time `owner.name` inclusively under `label`; `after(t)` runs with the return time."
    f = getattr(owner, name)
    label = label or f"{getattr(owner, '__name__', owner)}.{name}"

    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally:
            t1 = time.perf_counter(); T[label] += t1 - t0; N[label] += 1
            if after is not None: after(t1)
    setattr(owner, name, g)


def gaps(prof, steps: int) -> dict:
    """The device's idle time a step between kernels (gaps over 5 µs), summed by the pair of kernels around each gap:
    where in a round the GPU waits for the host."""
    ks = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    by, total = defaultdict(float), 0.0
    for a, b in zip(ks, ks[1:]):
        gap = b.time_range.start - a.time_range.end
        if gap > 5:
            total += gap; by[f"{a.name[:50]} -> {b.name[:50]}"] += gap
    top = sorted(by.items(), key=lambda kv: -kv[1])[:8]
    return {"idle_us_per_step": round(total / steps, 1), "top": [(k, round(v / steps, 1)) for k, v in top]}


def main(a) -> None:
    import dspark
    from dspark.runtime import overlap, graphs, runner, fused_round
    from dspark.spec import proposers
    from dspark.sample import structured
    from dspark.kernels import markov
    from dspark.engine import core, scheduler
    from dspark.engine.core import frozen_heap
    from v4_flash_decode import SCHEMA, overrides

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    kw = dict(load_format="dummy", quantization="auto", hf_overrides=overrides(a.model, a.layers)) if a.model.startswith("deepseek") else {}
    sim = a.simulate_acceptance if a.model.startswith("deepseek") else None
    engines = {}
    for mode in a.modes:
        spec, k = (None, None) if mode == "none" else (mode, a.k if mode == "mtp" else None)
        engines[mode] = lambda spec=spec, k=k: dspark.LLM(
            model=a.model + ("/mtp" if spec == "mtp" else ""), device="cuda" if cuda else "cpu",
            dtype="bfloat16" if cuda else "float32", **kw, speculative=spec, num_speculative_tokens=k,
            simulate_acceptance=sim if spec else None, max_model_len=1024, max_num_seqs=max(a.concurrency),
            max_num_batched_tokens=2048, gpu_memory_utilization=0.9 if kw else None,
            kv_cache_memory_bytes=None if kw else 2**30, enable_prefix_caching=False)
    # the chain: the verify's result on the host (VerifyAhead.take returns) .. the next verify replayed (launch returns)
    def took(t): MARK["took"] = t
    def launched(t):
        if "took" in MARK: CHAIN["take_to_launch"].append(t - MARK.pop("took"))
    def masked_done(t):
        if "took" in MARK: CHAIN["take_to_masked_done"].append(t - MARK["took"])
    def hidden_done(t):
        if "took" in MARK: CHAIN["take_to_hidden"].append(t - MARK["took"])
    wrap(overlap.VerifyAhead, "take", after=took)
    wrap(overlap.VerifyAhead, "launch", after=launched)
    wrap(runner.ModelRunner, "_propose_masked", after=masked_done)
    wrap(graphs.DraftGraphs, "hidden", after=hidden_done)
    for owner, names in [(core.EngineCore, ["step", "_schedule", "_outputs", "_cut"]),
                         (runner.ModelRunner, ["execute", "_finish", "_adopt", "settle", "_propose_all"]),
                         (scheduler.Scheduler, ["update", "schedule"]),
                         (structured.Grammars, ["walk", "mask_words", "_matcher"]),
                         (structured.DraftWalk, ["_walk", "close", "forced"]),
                         (markov.MaskedSteps, ["step"]),
                         (graphs.GraphRunner, ["__call__"]),
                         (overlap.RoundAhead, ["take", "launch_next", "launch_first"]),
                         (overlap.DecodeAhead, ["step"]),
                         (fused_round.RoundGraphs, ["__call__", "launch"]),
                         (fused_round.Round, ["drafts"]),
                         (fused_round.RoundGraphs, ["advance", "_replay", "snapshot", "snapshot_for", "read", "can_advance"]),
                         (graphs.GraphRunner, ["graphs_for_lens", "_graphs_for"]),
                         (graphs.DraftGraphs, ["__call__", "_fill", "_replay"]),
                         (proposers.DSparkProposer, ["propose_greedy", "_read", "allocate", "collect"]),
                         (runner.SimulatedAcceptance, ["accept"]),
                         (torch.cuda.Event, ["synchronize", "record"]), (torch.cuda.Stream, ["synchronize"])]:
        for n in names: wrap(owner, n)
    for mod, n in ((graphs, "fill_buffers"), (fused_round, "fill_layout"), (overlap, "unpack_masks"), (overlap, "_to_device")):
        wrap(mod, n, f"{mod.__name__.split('.')[-1]}.{n}")
    replay = torch.cuda.CUDAGraph.replay
    def labelled(self):                       # each graph replay's host time, by the function that replays it
        t0 = time.perf_counter()
        try: return replay(self)
        finally:
            f = sys._getframe(1).f_code
            k = f"CUDAGraph.replay<{f.co_name}:{Path(f.co_filename).stem}>"
            T[k] += time.perf_counter() - t0; N[k] += 1
    torch.cuda.CUDAGraph.replay = labelled
    out = {"gpu": torch.cuda.get_device_name() if cuda else "cpu", "model": a.model, "layers": a.layers, "tokens": a.tokens}
    g = torch.Generator().manual_seed(0)
    for mode, make in engines.items():
        llm = make()
        V = llm.model.cfg.vocab_size
        for c in a.concurrency:
            prompts = [torch.randint(0, V, (a.prompt,), generator=g).tolist() for _ in range(c)]
            for js in ([False, True] if a.schema else [False]) * 2:
                sp = dspark.SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True,
                                           structured_outputs={"json": SCHEMA} if js else None)
                llm.generate(prompts, dspark.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                            structured_outputs=sp.structured_outputs), use_tqdm=False)
                T.clear(); N.clear(); CHAIN.clear(); MARK.clear()
                s0 = llm.spec_stats()["num_drafts"] if mode != "none" else 0
                with frozen_heap():                    # as the server runs: no collector pass over the engine
                    sync(); t0 = time.perf_counter()
                    llm.generate(prompts, sp, use_tqdm=False)
                    sync(); dt = time.perf_counter() - t0
                steps = N["EngineCore.step"]
                rounds = (llm.spec_stats()["num_drafts"] - s0) / c if mode != "none" else steps
                key = f"{mode}_C{c}" + ("_schema" if js else "")
                row = {"wall_ms": round(dt * 1e3, 2), "steps": steps, "rounds_per_request": round(rounds, 1),
                       "ms_per_step": round(dt * 1e3 / max(steps, 1), 3),
                       "tok_s": round(c * a.tokens / dt, 1),
                       "per_step_us": {k: round(T[k] / max(steps, 1) * 1e6, 1) for k in sorted(T, key=T.get, reverse=True)},
                       "calls_per_step": {k: round(N[k] / max(steps, 1), 2) for k in N},
                       "chain_us_median": {k: round(sorted(v)[len(v) // 2] * 1e6, 1) for k, v in CHAIN.items() if v}}
                if cuda and a.gpu_busy:                # kernel time a step, from a profiled run of the same batch
                    from torch.profiler import ProfilerActivity, profile
                    steps0 = N["EngineCore.step"]
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        llm.generate(prompts, sp, use_tqdm=False); sync()
                    busy = sum(e.self_device_time_total for e in prof.key_averages())
                    nsteps = max(N["EngineCore.step"] - steps0, 1)
                    row["gpu_busy_us_per_step"] = round(busy / nsteps, 1)
                    row["gaps"] = gaps(prof, nsteps)
                out[key] = row
                print(key, json.dumps(row, indent=1), flush=True)
        del llm
        if cuda: torch.cuda.empty_cache()
    Path(os.environ.get("OUT", "/tmp"), "host_phases.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v4-flash-0731")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--modes", nargs="+", default=["dspark"], help="none, dspark, mtp")
    ap.add_argument("--k", type=int, default=2, help="MTP's speculative tokens")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gpu-busy", action="store_true", help="also a profiled run: kernel time a step")
    ap.add_argument("--schema", action="store_true", help="each row also under a JSON schema")
    ap.add_argument("--simulate-acceptance", type=float, default=3.34)
    main(ap.parse_args())
