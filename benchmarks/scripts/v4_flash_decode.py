"""DeepSeek-V4-Flash at full width, all 256 experts, dummy weights as stored, on one GPU: decode and prefill speed of
the engine with the FP8/FP4 kernels (chapters 18a, 18b), against the HBM floor of the bytes a step reads.

    python benchmarks/scripts/v4_flash_decode.py [--layers N] [--eager]     # writes $OUT/v4_flash_decode.json

Decode tok/s at concurrency C comes from two greedy runs of C requests that differ only in max_tokens (16 and 16 + T):
T·C tokens over the difference of their times, so prefill and start-up cancel. The C1 floor is the stored bytes one
decode step must read (every weight but the embedding and the unselected experts: 6 experts a layer) over this GPU's
device-to-device copy bandwidth. Prefill: one prompt of 4,096 tokens, its time to first token, and MFU against
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


def main(a) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    import dspark
    from dspark.tools.records import git_commit
    total = torch.cuda.mem_get_info()[1]
    n = a.layers
    if not n:
        from importlib.util import module_from_spec, spec_from_file_location
        spec = spec_from_file_location("res", Path(__file__).with_name("v4_flash_resident.py"))
        res = module_from_spec(spec); spec.loader.exec_module(res)
        n = res.layers_that_fit(total, a.max_model_len, 8, a.tokens) - a.headroom
    out = {"commit": git_commit(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "layers": n,
           "eager": a.eager, "copy_TB_s": round(copy_tb_s(), 3), "rows": {}}
    t0 = time.perf_counter()
    llm = dspark.LLM(model="deepseek-v4-flash", load_format="dummy", quantization="auto",
                     hf_overrides={"num_hidden_layers": n}, device="cuda", dtype="bfloat16", enforce_eager=a.eager,
                     max_model_len=a.max_model_len, max_num_seqs=max(a.concurrency), max_num_batched_tokens=a.tokens,
                     gpu_memory_utilization=0.92)
    out["build_s"] = round(time.perf_counter() - t0, 1)
    out["profile"] = llm.engine.profile.splitlines()
    nbytes, active = step_bytes(llm.model)
    out["c1_step_bytes"], out["active_params"] = nbytes, active
    out["c1_floor_ms"] = round(nbytes / (out["copy_TB_s"] / 2 * 1e12) * 1e3, 3)   # copy reads at half its read+write rate
    g = torch.Generator().manual_seed(0)
    V = llm.model.cfg.vocab_size
    sp = lambda m: dspark.SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)

    def timed(prompts, m) -> float:
        torch.cuda.synchronize(); t = time.perf_counter()
        llm.generate(prompts, sp(m), use_tqdm=False)
        torch.cuda.synchronize(); return time.perf_counter() - t

    for c in a.concurrency:
        try:
            prompts = [torch.randint(0, V, (32,), generator=g).tolist() for _ in range(c)]
            timed(prompts, 4)                                      # warm-up: compile, first replays
            short, long = timed(prompts, 16), timed(prompts, 16 + a.decode_tokens)
            dt = long - short
            row = {"tok_s": round(c * a.decode_tokens / dt, 1), "step_ms": round(dt / a.decode_tokens * 1e3, 3)}
            if c == 1: row["over_floor"] = round(row["step_ms"] / out["c1_floor_ms"], 2)
        except Exception as e:
            row = {"error": f"{type(e).__name__}: {str(e)[:300]}"}; traceback.print_exc(limit=3)
        out["rows"][f"C{c}"] = row; print(c, row, flush=True)
    for L in a.prefill:
        try:
            prompt = torch.randint(0, V, (L,), generator=g).tolist()
            timed([prompt[:64]], 1)
            dt = timed([prompt], 1)
            out["rows"][f"prefill{L}"] = {"s": round(dt, 3), "tok_s": round(L / dt, 1),
                                          "mfu_linear": round(2 * active * L / dt / (a.peak_tflops * 1e12), 4)}
        except Exception as e:
            out["rows"][f"prefill{L}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}; traceback.print_exc(limit=3)
        print(L, out["rows"][f"prefill{L}"], flush=True)
    out["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    text = json.dumps(out, indent=1)
    print(text)
    Path(os.environ.get("OUT", "/tmp"), f"v4_flash_decode{'_eager' if a.eager else ''}.json").write_text(text + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--headroom", type=int, default=2, help="layers fewer than the eager plan fits (graph pools)")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument("--prefill", type=int, nargs="*", default=[4096])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--tokens", type=int, default=4096, help="max_num_batched_tokens")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the card (H100/H200 SXM: 989)")
    main(ap.parse_args())
