"""How `compress_step_` scales with the batch (H200): one launch at N = 64 / 256 tokens of the medium preset's
compressor shapes (ratio 4 with overlap: dim 512, and its 128-dim indexer; ratio 128: dim 512), with every token
completing a window or none. OUT=. python compress_scaling.py"""
import json, os, sys, torch
sys.path.insert(0, os.path.dirname(__file__))
from round_profile_lib import ev_time
from dspark.kernels.step import compress_step_
from dspark.cache.kv_cache import ring_size
res = {"gpu": torch.cuda.get_device_name(), "runs": []}
dev = "cuda"
for ratio, overlap, dim in ((4, True, 512), (4, True, 128), (128, False, 512)):
    W = dim * (2 if overlap else 1); R = ring_size(ratio, overlap, 0); bs = 256
    for N in (64, 256):
        for complete in (True, False):
            g = torch.Generator(device=dev).manual_seed(0)
            kv = torch.randn(N, W, device=dev, dtype=torch.bfloat16, generator=g)
            sc = torch.randn(N, W, device=dev, dtype=torch.bfloat16, generator=g)
            ape = torch.randn(ratio, W, device=dev)
            ring = tuple(torch.randn(N + 1, R, W, device=dev, generator=g) for _ in range(2))
            p0 = 10 * ratio - 1 if complete else 10 * ratio
            pos = torch.full((N,), p0, dtype=torch.int32, device=dev)
            req = torch.arange(N, dtype=torch.int32, device=dev)
            slot = torch.arange(N, device=dev)
            tables = torch.arange(N * 8, dtype=torch.int32, device=dev).view(N, 8)
            pool = torch.zeros(N * 8 + 1, bs // ratio, dim, device=dev, dtype=torch.bfloat16)
            w = torch.ones(dim, device=dev); inv = torch.rand(32, device=dev)
            fn = lambda: compress_step_(kv, sc, ape, ring, slot, req, pos, tables, pool, w, inv, ratio, overlap, bs, 1e-6)
            us = ev_time(fn) * 1e3
            run = dict(ratio=ratio, dim=dim, N=N, complete=complete, us=round(us, 2))
            print(run, flush=True); res["runs"].append(run)
json.dump(res, open(os.environ["OUT"] + "/compress_scaling.json", "w"), indent=1)
