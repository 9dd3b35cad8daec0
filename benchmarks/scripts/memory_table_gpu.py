"""The working-memory table: for each of the engine's eight working-memory reductions (chapter 22c: the three mHC
stream buffers, the in-place query, the shared logits buffer, the in-graph draft distributions, the skipped MTP
staging, the head on sampled rows alone), the bytes it saves at V4-Flash width, measured by switching it off, and the KV tokens those bytes hold;
then the KV tokens at a fixed memory budget with all seven on and all seven off.

    python benchmarks/scripts/memory_table_gpu.py                  # V4-Flash-0731 width, 4 layers, one GPU: $OUT/memory_table.json
    python benchmarks/scripts/memory_table_gpu.py --cpu-smoke      # the tiny preset on the CPU: every path, nothing measured

The model is the DSpark config (hidden 4096, 64 heads x 512, all 256 experts top-6, vocab 129,280) with dummy
weights as stored (FP8 linears, FP4 experts) cut to `--layers` layers, its drafter reading the last three. Each
setting is measured three ways, with the switches set before anything is built:

- `step`: the peak working memory of one eager prefill step of `--tokens` tokens (the engine's own
  `step_peak_bytes`; the Triton forward with the fused mHC kernels, the DSpark taps; the last streams staged when
  `skip_mtp_staging` is off),
- `graphs`: the bytes the target's CUDA graphs hold once captured (`GraphRunner.graph_bytes`: decode/verify buckets
  for `--max-num-seqs` requests of 1 + K tokens, ragged buckets up to `--ragged-tokens`),
- `draft`: the bytes the DSpark draft graphs hold (`DraftGraphs`: greedy and sampled steps per request bucket),

each only for the settings that can change it (the rest reuse the all-on figure, marked `reused`). A row's saving is
its setting's total (step + graphs + draft) less its baseline's; the baseline is all-on, except for `pingpong`,
which only acts with `inplace_post` off and is measured against that. KV tokens divide the saving by the engine's
`kv_bytes_per_token` of the full 43-layer config (the "B/token" of its start-up line) in bf16 and in FP8 rows.
`expected_bytes` is `reduction_estimates` (shapes alone). Each setting's step logits, graph-step logits and sampled
drafts are compared with all-on's (`max_abs_err`, `drafts_equal`). The budget rows plan the 43-layer cache
(`plan_cache`) in `--budget-gib` less the measured working memory. Writes $OUT/memory_table.json (OUT defaults to
/tmp) after every row, in the records' schema: copy it to benchmarks/records/ to show it in chapter 22c.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch

# (row, switches off, baseline's switches off); `pingpong` acts only once `inplace_post` is off
ROWS = [("fuse_final", ("fuse_final",), ()), ("inplace_post", ("inplace_post",), ()),
        ("pingpong", ("inplace_post", "pingpong"), ("inplace_post",)), ("inplace_q", ("inplace_q",), ()),
        ("skip_mtp_staging", ("skip_mtp_staging",), ()), ("shared_logits", ("shared_logits",), ()),
        ("graph_draft_q", ("graph_draft_q",), ()), ("sampled_logits", ("sampled_logits",), ())]
# which measurement each switch can change (the eager step does not capture; the draft step has no mHC streams to
# reuse, no target logits and no finals)
AFFECTS = {"step": {"fuse_final", "inplace_post", "pingpong", "inplace_q", "skip_mtp_staging", "sampled_logits"},
           "graphs": {"fuse_final", "inplace_post", "pingpong", "inplace_q", "skip_mtp_staging", "shared_logits"},
           "draft": {"inplace_q", "graph_draft_q"}}


def git_commit() -> str | None:
    try: return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError): return None


class Meter:
    "Device memory, measured on CUDA; on the CPU (`--cpu-smoke`) every figure is None: the paths run, nothing is measured."
    def __init__(self, cuda: bool): self.cuda = cuda

    def free(self) -> int | None:
        if not self.cuda: return None
        gc.collect(); torch.cuda.synchronize(); torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]

    def held(self, build):
        "`(build(), bytes it still holds)`: free memory before less after."
        f0 = self.free()
        out = build()
        f1 = self.free()
        return out, (None if f0 is None else f0 - f1)


def build_engine(a):
    "The engine (eager: its graphs are captured here, per setting) and the full-depth config its KV is priced at."
    import dspark
    from dspark.config import load_config, named_configs, resolve_model
    if a.cpu_smoke:
        ckpt = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="tiny", seed=0)
        llm = dspark.LLM(ckpt, speculative="dspark", device="cpu", dtype="float32", max_num_seqs=a.max_num_seqs,
                         max_model_len=a.max_model_len, kv_cache_memory_bytes=16 * 2**20, enable_prefix_caching=False)
        return llm, llm.model.cfg
    over = {"num_hidden_layers": a.layers, "dspark_target_layer_ids": list(range(max(0, a.layers - 3), a.layers))}
    llm = dspark.LLM(model=a.model, load_format="dummy", quantization="auto", hf_overrides=over, device="cuda",
                     dtype="bfloat16", speculative="dspark", enforce_eager=True, max_num_seqs=a.max_num_seqs,
                     max_model_len=a.max_model_len, max_num_batched_tokens=a.tokens, kv_cache_memory_bytes=2 * 2**30,
                     enable_prefix_caching=False)
    return llm, load_config(resolve_model(a.model) if a.model in named_configs() else a.model)


def measure(llm, a, meter: Meter, offs: tuple[str, ...], which: set[str]) -> dict:
    """One setting (`offs` switched off, the rest on): the parts of `which` measured, and the outputs the equality
    check compares: the eager step's logits, a graph step's logits, a sampled draft step's drafts and distributions."""
    from dspark.cache.kv_cache import SeqView
    from dspark.runtime.buffers import fill_buffers
    from dspark.runtime.graphs import DraftGraphs, GraphRunner, fast_path
    from dspark.config import PROMPT_LOGPROB_ROWS
    from dspark.runtime.memory import reductions_set, step_peak_bytes
    from dspark.sample.sampling import SamplingParams
    r, pr, model = llm.runner, llm.runner.proposer, llm.model
    cfg, dev, dt = model.cfg, model.embed.weight.device, model.embed.weight.dtype
    out: dict = {}
    with reductions_set(**dict.fromkeys(offs, False)):
        mhc_fns = fast_path(model)                         # the fused mHC kernels on a GPU, the references on the CPU
        if pr.drafter is not None: pr.drafter.mhc = fast_path(pr.drafter)   # its RoPE tables on the device: the target
                                                           # graphs write its context rows (as graphs_for_runner does first)
        if meter.cuda: from dspark.kernels.fused import forward_batched as forward
        else: from dspark.cache.kv_cache import forward_cached as forward
        # the eager step as the engine's graph runner runs it: with `skip_mtp_staging` off, the last streams staged
        fwd = functools.partial(forward, mhc=mhc_fns, finals=[] if "skip_mtp_staging" in offs else None)
        if "step" in which:
            if meter.cuda:
                # the head on the rows a step samples, as the engine's plan (`profile_memory`) counts them
                rows = (a.max_num_seqs * (pr.drafter.block_size + 1) + PROMPT_LOGPROB_ROWS
                        if "sampled_logits" not in offs else None)
                out["step"] = min(step_peak_bytes(model, fwd, a.tokens, a.max_model_len, r.cache.cc.block_size, dt, pr.taps,
                                                  rows) for _ in range(2))
            else: out["step"] = None
            t = list(range(r.cache.cc.num_window_blocks))[:4]
            ids = torch.arange(3, 3 + min(a.tokens, 64), device=dev) % cfg.vocab_size
            out["step_logits"] = fwd(model, r.cache, [ids], [SeqView(t, t, 0, 0)], pr.taps, [])[0].float().cpu()
        if "graphs" in which:
            g = GraphRunner(model, r.cache, forward, a.max_num_seqs, r.cache.cc.lookahead, a.max_model_len, taps=pr.taps,
                            finals=False, capture=meter.cuda, context=pr.write_context, ragged_tokens=a.ragged_tokens)
            out["graphs"] = g.graph_bytes if meter.cuda else None     # the pools, and the shared logits when on
            out["sizes"] = g.sizes + g.ragged_sizes
            m = g.max_query                                # one request's verify step: its first 1 + K tokens
            n, t = next(s for s in g.sizes if s >= m), [0]      # one block holds the step
            fill_buffers(g.buf, [torch.arange(3, 3 + m, device=dev)], [SeqView(t, t, 1, 0)], n, r.cache.scratch_slot)
            if meter.cuda: g.graphs[n][0].replay(); logits = g.graphs[n][1].logits
            else: logits = g.run(n).logits                 # on the CPU: the step a graph records, run uncaptured
            out["graph_logits"] = logits[:m].float().cpu()
            del g; meter.free()
        if "draft" in which:
            dg, held = meter.held(lambda: DraftGraphs(pr, a.max_num_seqs, capture=meter.cuda))
            out["draft"], out["draft_sizes"] = held, dg.sizes
            sp = [SamplingParams(temperature=0.8, seed=3), SamplingParams(temperature=1.0, top_k=20, seed=4)]
            drafts, _, _ = dg.sampled([0, 1], [5, 9], [4, 4], sp, [11, 12])
            out["drafts"], out["draft_q"] = drafts.cpu(), pr.q[[0, 1]].cpu()
            del dg; meter.free()
    return out


def main(a) -> None:
    from dspark.cache.kv_cache import kv_bytes_per_token, plan_cache
    from dspark.config import PROMPT_LOGPROB_ROWS
    from dspark.runtime.memory import kv_tokens_for, reduction_estimates
    import triton
    cuda = not a.cpu_smoke
    if cuda and not torch.cuda.is_available(): raise SystemExit("no GPU: run with --cpu-smoke for the CPU check")
    meter = Meter(cuda)
    t0 = time.perf_counter()
    llm, full = build_engine(a)
    cfg, K = llm.model.cfg, llm.runner.K
    print(f"engine built in {time.perf_counter() - t0:.0f} s: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
          f"{cfg.n_routed_experts} experts, K={K}; KV priced at {full.num_hidden_layers} layers: "
          f"{kv_bytes_per_token(full):.0f} B/token bf16, {kv_bytes_per_token(full, fp8=True):.0f} fp8", flush=True)
    path = Path(os.environ.get("OUT", "/tmp")) / "memory_table.json"
    rec = {"commit": git_commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "machine": {"gpu": torch.cuda.get_device_name() if cuda else "cpu (smoke: nothing measured)",
                       "torch": torch.__version__, "triton": triton.__version__},
           "command": "python benchmarks/scripts/memory_table_gpu.py " + " ".join(sys.argv[1:]),
           "config": {"what": f"working memory saved by each reduction, switched off in turn: {a.model} width, "
                              f"{cfg.num_hidden_layers} layers, {cfg.n_routed_experts} experts, dummy weights as stored; "
                              f"KV tokens at {full.num_hidden_layers} layers",
                      "layers": cfg.num_hidden_layers, "tokens": a.tokens, "max_num_seqs": a.max_num_seqs, "K": K,
                      "ragged_tokens": a.ragged_tokens, "max_model_len": a.max_model_len, "budget_GiB": a.budget_gib,
                      "kv_bytes_per_token_bf16": kv_bytes_per_token(full),
                      "kv_bytes_per_token_fp8": kv_bytes_per_token(full, fp8=True)},
           "rows": []}
    save = lambda: path.write_text(json.dumps(rec, indent=1) + "\n")
    every = tuple(dict.fromkeys(o for _, offs, _ in ROWS for o in offs))
    settings = {(): "all_on", **{offs: name for name, offs, _ in ROWS}, every: "all_off"}   # each rows' and baselines'
    pr = llm.runner.proposer
    pr.alloc_q(cfg.vocab_size)                      # the draft store exists in every setting: not a setting's bytes
    got: dict[tuple, dict] = {}
    t1 = time.perf_counter()                        # a first build pays one-time costs (Triton modules, library
    cold = measure(llm, a, meter, (), set(AFFECTS)) # workspaces, allocator pools) that no later setting repeats
    print(f"  measured all_on (cold, discarded) in {time.perf_counter() - t1:.0f} s", flush=True)
    for offs in settings:
        t1 = time.perf_counter()
        which = {k for k, s in AFFECTS.items() if not offs or offs == every or s & set(offs)}
        got[offs] = m = measure(llm, a, meter, offs, which)
        for k in ("step", "graphs", "draft"):
            if k not in which: m[k], m[f"{k}_reused"] = got[()][k], True
        for k in ("step_logits", "graph_logits", "drafts", "draft_q", "sizes", "draft_sizes"):
            m.setdefault(k, got[()].get(k))
        print(f"  measured {settings[offs]}: {sorted(which)} in {time.perf_counter() - t1:.0f} s: step/graphs/draft bytes "
              f"{[m[k] for k in ('step', 'graphs', 'draft')]}", flush=True)     # a run cut short still tells
    base = got[()]
    again = measure(llm, a, meter, (), set(AFFECTS))    # all-on once more, last: the A/A spread of the table
    rec["config"]["all_on_bytes"] = {k: [cold[k], base[k], again[k]] for k in ("step", "graphs", "draft")}
    print(f"  all_on step/graphs/draft bytes, cold / first / last: {rec['config']['all_on_bytes']}", flush=True)
    est = reduction_estimates(cfg, a.tokens, base["sizes"], base["draft_sizes"], pr.drafter.block_size,
                              llm.model.embed.weight.element_size(),
                              a.max_num_seqs * (pr.drafter.block_size + 1) + PROMPT_LOGPROB_ROWS)
    total = lambda m: None if None in (m["step"], m["graphs"], m["draft"]) else m["step"] + m["graphs"] + m["draft"]
    err = lambda x, y: None if x is None or y is None else float((x - y).abs().max())
    for name, offs, base_offs in ROWS:
        m, b = got[offs], got[base_offs]
        saved = None if total(m) is None else total(m) - total(b)
        row = {"reduction": name, "where": "+".join(k for k in ("step", "graphs", "draft") if not m.get(f"{k}_reused")),
               "off": list(offs), "baseline_off": list(base_offs),
               **{f"{k}_bytes_off": m[k] for k in ("step", "graphs", "draft")},
               **{f"{k}_bytes_baseline": b[k] for k in ("step", "graphs", "draft")},
               "saved_bytes": saved, "expected_bytes": est[name], "expected_kv_tokens": kv_tokens_for(est[name], full),
               "kv_tokens": None if saved is None else kv_tokens_for(saved, full),
               "kv_tokens_fp8": None if saved is None else kv_tokens_for(saved, full, fp8=True),
               "step_max_abs_err": err(m["step_logits"], b["step_logits"]),
               "graph_max_abs_err": err(m["graph_logits"], b["graph_logits"]),
               "drafts_equal": bool(torch.equal(m["drafts"], b["drafts"])),
               "draft_q_max_abs_err": err(m["draft_q"], b["draft_q"])}
        row["equal"] = row["drafts_equal"] and all(row[k] is not None and row[k] <= a.tolerance
                                                   for k in ("step_max_abs_err", "graph_max_abs_err", "draft_q_max_abs_err"))
        rec["rows"].append(row); save()
        mib = lambda v: "   n/a" if v is None else f"{v / 2**20:8.1f}"
        print(f"{name:17s} saved {mib(saved)} MiB (expected {mib(est[name])}) = "
              f"{'n/a' if saved is None else format(row['kv_tokens'], ','):>9} KV tokens bf16 "
              f"({'n/a' if saved is None else format(row['kv_tokens_fp8'], ',')} fp8); where {row['where']}; "
              f"errors step {row['step_max_abs_err']} graph {row['graph_max_abs_err']} draft q {row['draft_q_max_abs_err']}, "
              f"drafts equal {row['drafts_equal']}", flush=True)
    budget = int(a.budget_gib * 2**30)
    for label, offs in (("all_on", ()), ("all_off", every)):
        work = total(got[offs])
        row = {"reduction": f"budget_{label}", "budget_bytes": budget, "working_bytes": work}
        for kv, fp8 in (("kv_tokens", False), ("kv_tokens_fp8", True)):
            if work is None: row[kv] = None; continue
            try:
                cc = plan_cache(full, budget - work, llm.runner.cache.cc.block_size, a.max_num_seqs, a.tokens, K,
                                torch.bfloat16, fp8)
                row[kv] = cc.num_blocks * cc.block_size
            except ValueError as e: row[kv], row["error"] = 0, str(e)
        rec["rows"].append(row); save()
        print(f"budget {a.budget_gib} GiB, reductions {label:7s}: working {'n/a' if work is None else f'{work / 2**30:.2f} GiB'}"
              f" -> {row['kv_tokens']} KV tokens bf16, {row['kv_tokens_fp8']} fp8", flush=True)
    print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v4-flash-0731", help="a named config with a DSpark drafter")
    ap.add_argument("--layers", type=int, default=4, help="target layers kept (the working memory is per step, not per layer)")
    ap.add_argument("--tokens", type=int, default=2048, help="the eager prefill step measured (max_num_batched_tokens)")
    ap.add_argument("--max-num-seqs", type=int, default=16, help="requests the decode/verify and draft graphs are captured for")
    ap.add_argument("--ragged-tokens", type=int, default=256, help="largest ragged (prefill) graph bucket")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--budget-gib", type=float, default=16.0,
                    help="KV + working memory of one rank (two 96 GB cards less 159.6 GB of weights: about 16 GB each)")
    ap.add_argument("--tolerance", type=float, default=0.125, help="largest logit difference counted as equal (the fused final sums in another order)")
    ap.add_argument("--cpu-smoke", action="store_true", help="the tiny preset on the CPU: runs every path, measures nothing")
    a = ap.parse_args()
    if a.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.tokens, a.max_num_seqs, a.ragged_tokens, a.max_model_len = min(a.tokens, 32), min(a.max_num_seqs, 2), 0, 96
    main(a)
