"""DeepSeek-V4-Flash at full width, all 256 experts, dummy weights as stored, on one GPU: decode and prefill speed of
the engine with the FP8/FP4 kernels (chapters 18a, 18b), against the HBM floor of the bytes a step reads.

    python benchmarks/scripts/v4_flash_decode.py [--layers N] [--eager] [--tag T]   # writes $OUT/v4_flash_decode_T.json
    python benchmarks/scripts/v4_flash_decode.py --model deepseek-v4-flash-0731 --modes none dspark dspark:2 dspark+capacity \
        --simulate-acceptance 3.34 --concurrency 1 64 --prefill        # DSpark on dummy weights, simulated acceptance

Decode tok/s at concurrency C comes from two greedy runs of C requests that differ only in max_tokens (16 and 16 + T):
T·C tokens over the difference of their times, so prefill and start-up cancel; the median of `--repeats` such pairs
(one pair alone once put a one-off cost into its short run: a C1 step came out a third shorter than its own kernels take). Prompts have 32 tokens, or each of
`--prompt-len` (decode after a long context: the repeated prompt is a prefix-cache hit, so the runs differ in decode). The C1 floor is the stored bytes one
decode step must read (every weight but the embedding and the unselected experts: 6 experts a layer) over this GPU's
device-to-device copy rate (bytes read plus written per second: what HBM moves, whichever way). Prefill: one prompt of 4,096 tokens, its time to first token, and MFU against
`--peak-tflops` (the FP8 dense peak of the card: H100 SXM 989 bf16 / 1,979 FP8, H200 the same chip).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch


def copy_tb_s() -> float:
    "Device-to-device copy: bytes read plus written per second, TB/s."
    a, b = torch.empty(2**30, dtype=torch.uint8, device="cuda"), torch.empty(2**30, dtype=torch.uint8, device="cuda")
    for _ in range(3): b.copy_(a)
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): b.copy_(a)
    torch.cuda.synchronize()
    return 2 * 10 * 2**30 / (time.perf_counter() - t) / 1e12


def step_bytes(model) -> tuple[int, int]:
    "(bytes a C1 decode step reads: all weights but the embedding and unselected experts; active parameters per token)."
    from dspark.model.layers import MoE
    cfg, total, active = model.cfg, 0, 0
    experts = {id(p) for m in model.modules() if isinstance(m, MoE) for ex in m.experts for p in ex.parameters()}
    for name, p in model.named_parameters():
        if name == "embed.weight" or id(p) in experts: continue
        total += p.numel() * p.element_size()
        active += p.numel() * (2 if p.dtype == torch.int8 else 1) if p.dim() == 2 and p.dtype != torch.float8_e8m0fnu else 0
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    ex = moes[0].experts[0]
    ex_bytes = sum(p.numel() * p.element_size() for p in ex.parameters())
    ex_params = sum(p.numel() * (2 if p.dtype == torch.int8 else 1) for p in ex.parameters() if p.dtype != torch.float8_e8m0fnu)
    k = cfg.num_experts_per_tok
    return total + len(moes) * k * ex_bytes, active + len(moes) * k * ex_params


SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "status": {"enum": ["open", "closed"]},
                                           "note": {"type": "string", "minLength": 2000}},
          "required": ["id", "status", "note"], "additionalProperties": False}
"""`--schema`: a JSON schema whose document cannot end within a run (a note of at least 2,000 characters), so every
timed token is decoded under the grammar, however the dummy weights choose."""


def overrides(model: str, n: int) -> dict:
    "The named config cut to `n` layers; a DSpark config's drafter reads the last three, as the shipped one reads 40-42 of 43."
    over = {"num_hidden_layers": n}
    if model.endswith("0731"): over["dspark_target_layer_ids"] = list(range(max(0, n - 3), n))
    return over


def run_mode(a, mode: str, n: int, out: dict, save) -> None:
    "Build the engine for `mode` (none | dspark | dspark+capacity), then its decode rows and prefill rows."
    import dspark
    if a.dense_wo_a:                                  # the A/B baseline: wo_a dequantised for its einsum every step
        import dspark.runtime.graphs as graphs
        graphs.fp8_grouped_linear = lambda *args: None
    from dspark.kernels.attention import PDL
    PDL["allowed"] = not mode.endswith("/plain")                  # MODE/plain: the kernels launched plainly (no PDL)
    base = mode.removesuffix("/plain")
    spec = None if base == "none" else "dspark"
    from dspark.spec.controller import CapacityConfig            # dspark+capacity+plain: depth 0 allowed too
    capacity = {"dspark+capacity": "auto", "dspark+capacity+plain": CapacityConfig(plain_switch=True)}.get(base)
    K = int(base.split(":")[1]) if ":" in base else None          # dspark:K: K drafts verified a round, fixed
    t0 = time.perf_counter()
    llm = dspark.LLM(model=a.model, load_format="dummy", quantization=a.quantization, hf_overrides=overrides(a.model, n),
                     device="cuda", dtype="bfloat16", enforce_eager=a.eager, speculative=spec,
                     simulate_acceptance=a.simulate_acceptance if spec else None,
                     capacity=capacity, num_speculative_tokens=K,
                     max_model_len=a.max_model_len, max_num_seqs=max(a.concurrency), max_num_batched_tokens=a.tokens,
                     gpu_memory_utilization=0.92)
    m = out["modes"].setdefault(mode, {"rows": {}})
    m["build_s"] = round(time.perf_counter() - t0, 1)
    m["pdl"] = PDL["on"]
    m["profile"] = llm.engine.profile.splitlines()
    if "c1_floor_ms" not in out:
        nbytes, active = step_bytes(llm.model)
        out["c1_step_bytes"], out["active_params"] = nbytes, active
        out["c1_floor_ms"] = round(nbytes / (out["copy_TB_s"] * 1e12) * 1e3, 3)   # HBM moves the copy's read+write rate
    save()
    g = torch.Generator().manual_seed(0)
    V = llm.model.cfg.vocab_size
    sp = lambda k, js=False: dspark.SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True,
                                                   structured_outputs={"json": SCHEMA} if js else None)

    from dspark.engine.core import frozen_heap

    def timed(prompts, k, js=False) -> float:
        with frozen_heap():                                        # as the server runs: no collector pass over the engine
            torch.cuda.synchronize(); t = time.perf_counter()
            llm.generate(prompts, sp(k, js), use_tqdm=False)
            torch.cuda.synchronize(); return time.perf_counter() - t

    base = [(c, P, js) for P in a.prompt_len for c in a.concurrency for js in ([False, True] if a.schema else [False])]
    cases = [(*b, "") for b in base]
    if a.schema and spec and a.ab_masked_steps:                   # the same engine, its masked loop back on copies
        cases += [(c, P, True, "_copies") for c, P, js in base if js]
    if spec and a.ab_verify_ahead:                                # the same engine, verify steps not launched ahead
        cases += [(*b, "_sync") for b in base]
    if spec and a.ab_unfused:                                     # the same engine, greedy rounds not fused (as
        cases += [(*b, "_unfused") for b in base if not b[2]]     # simulated acceptance ran before 2026-12-07)
    for c, P, js, tail in cases:
        if tail == "_copies" and getattr(dg := llm.engine.runner.proposer.graphs, "steps", None):
            m["masked_steps_buckets"] = sorted(dg.steps); dg.steps = {}
        if tail == "_sync" and llm.engine.runner.verify_ahead is not None:
            m["verify_ahead_used"] = llm.engine.runner.verify_ahead.used
            llm.engine.runner.verify_ahead = None
        if tail == "_unfused" and getattr(llm.engine.runner.forward, "rounds", None) is not None:
            m["rounds_used"] = llm.engine.runner.forward.rounds.replays
            llm.engine.runner.forward.rounds = llm.engine.runner.round_ahead = None
        key = (f"C{c}" if P == 32 else f"C{c}_prompt{P}") + ("_schema" if js else "") + tail
        try:
            prompts = [torch.randint(0, V, (P,), generator=g).tolist() for _ in range(c)]
            timed(prompts, 4, js)                                  # warm-up: compile, first replays
            s0 = llm.spec_stats() if spec else None
            pairs = []
            for _ in range(a.repeats):                             # (seconds, rounds) the longer run adds
                r0 = llm.spec_stats()["num_drafts"] if spec else 0
                t0 = timed(prompts, 16, js)
                r1 = llm.spec_stats()["num_drafts"] if spec else 0
                t1 = timed(prompts, 16 + a.decode_tokens, js)
                pairs.append((t1 - t0, (llm.spec_stats()["num_drafts"] - r1) - (r1 - r0) if spec else 0))
            dts = sorted(d for d, _ in pairs)
            dt = dts[len(dts) // 2]                                # the median pair: a one-off cost in either run of a
            row = {"tok_s": round(c * a.decode_tokens / dt, 1), "step_ms": round(dt / a.decode_tokens * 1e3, 3),   # pair
                   "step_ms_pairs": [round(d / a.decode_tokens * 1e3, 3) for d in dts]}    # skews that pair alone
            if spec:                                               # a round's time does not depend on how many of its
                per_round = sorted(d * c / n for d, n in pairs if n > 0)   # drafts the simulation accepted (n counts a
                if per_round:                                      # round per request): the figure to compare
                    row["ms_per_round"] = round(per_round[len(per_round) // 2] * 1e3, 3)
                    if a.simulate_acceptance:                      # tok/s at exactly the simulated acceptance length
                        row["tok_s_at_simulated"] = round(c * a.simulate_acceptance / (row["ms_per_round"] / 1e3), 1)
                s1 = llm.spec_stats()
                d, acc = s1["num_drafts"] - s0["num_drafts"], s1["num_accepted_tokens"] - s0["num_accepted_tokens"]
                row["rounds"], row["mean_acceptance_length"] = d, round(1 + acc / max(d, 1), 3)
                row["ms_per_token_per_request"] = round(dt / a.decode_tokens * 1e3, 3)
                del row["step_ms"]
            elif c == 1 and P == 32 and not js: row["over_floor"] = round(row["step_ms"] / out["c1_floor_ms"], 2)
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}; traceback.print_exc(limit=3)
        m["rows"][key] = row; print(mode, key, row, flush=True); save()
    for L in a.prefill:
        try:
            prompt = torch.randint(0, V, (L,), generator=g).tolist()
            timed([torch.randint(0, V, (L,), generator=g).tolist()], 1)   # warm: the same shape, another prompt (no prefix hit)
            dt = timed([prompt], 1)
            m["rows"][f"prefill{L}"] = {"s": round(dt, 3), "tok_s": round(L / dt, 1),
                                        "mfu_linear": round(2 * out["active_params"] * L / dt / (a.peak_tflops * 1e12), 4)}
        except Exception as e:
            m["rows"][f"prefill{L}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}; traceback.print_exc(limit=3)
        print(mode, L, m["rows"][f"prefill{L}"], flush=True); save()
    m["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    del llm
    import gc; gc.collect(); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()


def main(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from dspark.tools.records import git_commit
    total = torch.cuda.mem_get_info()[1]
    n = a.layers
    if not n:
        from importlib.util import module_from_spec, spec_from_file_location
        spec = spec_from_file_location("res", Path(__file__).with_name("v4_flash_resident.py"))
        res = module_from_spec(spec); spec.loader.exec_module(res)
        n = res.layers_that_fit(total, a.max_model_len, 8, a.tokens) - a.headroom
    out = {"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "model": a.model,
           "quantization": a.quantization, "layers": n, "dense_wo_a": a.dense_wo_a, "eager": a.eager, "simulate_acceptance": a.simulate_acceptance,
           "copy_TB_s": round(copy_tb_s(), 3), "modes": {}}
    path = Path(os.environ.get("OUT", "/tmp"), f"v4_flash_decode_{a.tag}.json")
    save = lambda: path.write_text(json.dumps(out, indent=1) + "\n")
    for mode in a.modes:
        try: run_mode(a, mode, n, out, save)
        except Exception as e:
            out["modes"].setdefault(mode, {})["error"] = f"{type(e).__name__}: {str(e)[:400]}"; traceback.print_exc(limit=4)
            import gc; gc.collect(); torch.cuda.empty_cache()
        save()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek-v4-flash", help="a named config: deepseek-v4-flash or deepseek-v4-flash-0731")
    ap.add_argument("--modes", nargs="+", default=["none"],
                    help="none | dspark | dspark+capacity[+plain] | dspark:K (K drafts a round, fixed); with /plain after "
                         "it, the kernels launch without programmatic dependent launch")
    ap.add_argument("--simulate-acceptance", type=float, default=None, help="dummy weights: the speculative modes' mean acceptance length")
    ap.add_argument("--quantization", default="auto", choices=["auto", "none"], help="none: the bf16 path, for comparison")
    ap.add_argument("--tag", default="run", help="the output file is $OUT/v4_flash_decode_<tag>.json")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--dense-wo-a", action="store_true", help="baseline: wo_a dequantised, not the grouped FP8 kernel")
    ap.add_argument("--headroom", type=int, default=2, help="layers fewer than the eager plan fits (graph pools)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3, help="timed pairs per row; the row is their median")
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[32],
                    help="decode rows after prompts of these lengths (the timed runs repeat the prompt: a prefix hit, so only decode differs)")
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096])
    ap.add_argument("--ab-unfused", action="store_true",
                    help="a speculative mode's plain rows again with fused rounds off (key suffix _unfused), in the same process")
    ap.add_argument("--schema", action="store_true", help="each decode row also under a JSON schema (key suffix _schema)")
    ap.add_argument("--ab-masked-steps", action="store_true",
                    help="with --schema and a speculative mode: the schema rows again with the masked loop on copies "
                         "(DraftGraphs' MaskedSteps dropped; key suffix _schema_copies), in the same process")
    ap.add_argument("--ab-verify-ahead", action="store_true",
                    help="the speculative rows again with the runner's VerifyAhead off (key suffix _sync)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the card (H100/H200 SXM: 989)")
    main(ap.parse_args())
