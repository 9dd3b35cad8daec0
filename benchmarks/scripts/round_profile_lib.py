"""Timing and kernel-profile helpers shared by the profiling scripts (CUDA events; torch.profiler)."""
import collections, torch
from torch.profiler import profile, ProfilerActivity
def ev_time(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize(); a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize(); return a.elapsed_time(b) / n
def graph_us(fn, n=20, reps=7):
    "µs per call of `fn`: 20 calls captured in one CUDA graph, the median of 7 replays (launch cost excluded)."
    for _ in range(3): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b) * 1000 / n)
    return round(sorted(ts)[reps // 2], 2)
def kernels(fn, n=50, top=18):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n): fn()
        torch.cuda.synchronize()
    agg = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:60]]; a[0] += 1; a[1] += e.device_time
    ranked = sorted(agg.items(), key=lambda kv: -kv[1][1])
    return {"kernels_per_replay": round(sum(v[0] for v in agg.values()) / n, 1),
            "kernel_ms_per_replay": round(sum(v[1] for v in agg.values()) / n / 1000, 4),
            "top": [[k, round(v[0] / n, 1), round(v[1] / n, 2)] for k, v in ranked[:top]]}   # name, per replay, µs per replay
