"""The collapse's mixes from the split kernel against one fp32 GEMM (H200, bf16 streams, fp32 parameters): a
graph-replayed hc_pre_fused at the default model's and the medium preset's shapes, for 1..384 tokens and three
slice widths; checks each against the reference. OUT=. python hc_split.py"""
import json, os, torch
from dspark.model import layers
from dspark.config import preset
from dspark.kernels.hc import hc_pre_fused
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name(), "rows": []}
def replay_us(fn, n=300):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10): fn()
    g.replay(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record()
    for _ in range(n): g.replay()
    b.record(); torch.cuda.synchronize(); return 1e3 * a.elapsed_time(b) / n / 10
for name, D in (("default", 256), ("medium", 1024)):
    cfg = preset("tiny"); hc = cfg.hc_mult; rows = (2 + hc) * hc
    gen = torch.Generator().manual_seed(0)
    fn = (torch.randn(rows, hc * D, generator=gen) / (hc * D) ** 0.5).cuda()
    base, scale = (0.5 * torch.randn(rows, generator=gen)).cuda(), (torch.rand(3, generator=gen) + 0.5).cuda()
    for N in (1, 6, 8, 16, 32, 64, 128, 384):
        x = torch.randn(N, hc, D, generator=gen).cuda().bfloat16()
        want = layers.hc_pre(x, fn, base, scale, cfg)
        row = {"shape": name, "D": D, "tokens": N}
        for tag, kw in (("gemm", dict(split=False)), ("split128", dict(split=True, block_k=128)),
                        ("split256", dict(split=True, block_k=256)), ("split512", dict(split=True, block_k=512))):
            got = hc_pre_fused(x, fn, base, scale, cfg, **kw)
            err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, want))
            row[tag] = {"us": round(replay_us(lambda: hc_pre_fused(x, fn, base, scale, cfg, **kw)), 2), "max_err": err}
        print(json.dumps(row), flush=True); res["rows"].append(row)
json.dump(res, open(f"{OUT}/hc_split.json", "w"), indent=1)
