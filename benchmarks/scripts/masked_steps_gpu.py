"""The masked greedy Markov loop's cost a position on a GPU (chapter 17): `markov_masked_greedy_triton` on buffers of
its own (device buffers, copies, a Triton launch a position) against `MaskedSteps` mapped into pinned host memory and
captured as a graph a position, at V4-Flash-0731's vocabulary and Markov rank, 1 and 16 rows, γ positions a loop,
masks given (no grammar). First `masked_steps_check`, then the drafts of both must agree.

    OUT=. python benchmarks/scripts/masked_steps_gpu.py        # $OUT/masked_steps_gpu.json
"""
import json, os, sys, time
from pathlib import Path
import numpy as np, torch
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dspark.kernels.markov import MaskedSteps, markov_masked_greedy_triton, masked_steps_check
cfg = json.loads((Path(__file__).resolve().parents[2] / "dspark/models/configs/deepseek-v4-flash-0731/config.json").read_text())
V, D, rank, K = cfg["vocab_size"], cfg["hidden_size"], cfg.get("dspark_markov_rank", 64), cfg.get("dspark_block_size", 5)
dev, dt = "cuda", torch.bfloat16
g = torch.Generator().manual_seed(0)
w1, w2 = (torch.randn(V, rank, generator=g).to(dev, dt) for _ in range(2))
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "V": V, "D": D, "rank": rank, "K": K,
       "check": masked_steps_check(2, K, V, D, w1, w2)}
print(res, flush=True)
for R in (1, 16):
    U, h = torch.randn(R, K, V, generator=g).to(dev, dt), torch.randn(R, K, D, generator=g).to(dev, dt)
    anchors = torch.randint(0, V, (R,), generator=g).to(dev)
    words = [torch.randint(-2 ** 31, 2 ** 31 - 1, (R, (V + 31) // 32), generator=g, dtype=torch.int32).numpy() for _ in range(K)]
    allowed = lambda k, last: words[k]
    row = {}
    try:
        steps = MaskedSteps(U, h, anchors, w1, w2, K, mapped=True, capture=True)
        for name, kw in (("plain", {}), ("steps", {"steps": steps}), ("plain_again", {}), ("steps_again", {"steps": steps})):
            fn = lambda: markov_masked_greedy_triton(U, h, anchors, w1, w2, K, allowed, None, kw.get("steps"))
            out = fn(); torch.cuda.synchronize()
            ts = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(20): fn()
                ts.append((time.perf_counter() - t) / 20)
            row[name] = {"us_per_position": round(sorted(ts)[3] / K * 1e6, 1), "drafts": out.tolist()[0][:K]}
        row["agree"] = row["plain"]["drafts"] == row["steps"]["drafts"]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    res[f"R{R}"] = row
    print(R, json.dumps(row), flush=True)
Path(os.environ.get("OUT", "/tmp"), "masked_steps_gpu.json").write_text(json.dumps(res, indent=1))
