"""Chapter 18's two-launch MoE kernel against the grouped GEMM path, by step size, on the GPU: each captured 20 times
in a CUDA graph and replayed (device ms per call), at the embedded model's sizes (D 256, I 96, 8 experts, top-2)
and at a V4-Flash-like layer (D 4096, I 2048, top-8 of 32 experts here, to bound memory), bf16. Tells where
SMALL_MOE_PAIRS should sit. OUT=. python moe_small_gpu.py"""
import json, os, torch
from dspark.kernels.moe import small_moe_triton
from dspark.model.layers import StackedExperts, grouped_experts
from dspark.timing import device_ms as replay_ms
OUT, res = os.environ["OUT"], {"gpu": torch.cuda.get_device_name(), "rows": []}
g = torch.Generator(device="cuda").manual_seed(0)
for name, D, I, E, k in (("embedded", 256, 96, 8, 2), ("v4_flash_like", 4096, 2048, 32, 8)):
    w13 = (torch.randn(E, 2 * I, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
    w2 = (torch.randn(E, D, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    st = StackedExperts(w13, w2, (), torch.arange(E, device="cuda"))
    for N in (1, 2, 4, 6, 8, 16, 32, 64, 128):
        x = torch.randn(N, D, device="cuda", generator=g).bfloat16()
        idx = torch.stack([torch.randperm(E, device="cuda", generator=g)[:k] for _ in range(N)])
        wt = torch.rand(N, k, device="cuda", generator=g)
        row = {"layer": name, "tokens": N, "pairs": N * k}
        for path, fn in (("small", lambda: small_moe_triton(x, wt, idx, w13, w2, 0, 10.0)),
                         ("grouped", lambda: grouped_experts(x, wt, idx, st, 0, 10.0, whole=True))):
            for _ in range(3): fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20): fn()
            row[f"{path}_us"] = round(1000 * replay_ms(graph.replay, 20) / 20, 2)
        a, b = small_moe_triton(x, wt, idx, w13, w2, 0, 10.0), grouped_experts(x, wt, idx, st, 0, 10.0, whole=True)
        row["max_rel_diff"] = round(((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item(), 5)
        res["rows"].append(row); print(json.dumps(row), flush=True)
    del w13, w2, st; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/moe_small_gpu.json", "w"), indent=1)
