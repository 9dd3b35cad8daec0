"""Where a DSpark round's time goes at one request (H200, embedded model, bf16): the ordered kernels of one replay
of the fused round, of the greedy draft step and of the no-spec decode step (name, µs); the draft block attention
(the split-context kernel against the earlier one-program-per-row kernel, `old_kernels_draft.py`) and the Markov
loop at several vocabulary chunks, each captured 20 times in a graph and timed by the profiler; then no-spec and
DSpark decode at one request, 128 greedy tokens, 3 runs each.
The host's share of a round at one request: per round, how long the host waited for the verification (a wait means
the GPU, not the host, was the bottleneck) and how long from reading it to having launched the next round (the
path the draft step must cover). MICRO=1 adds the kernel microbenchmarks, against the first attention kernel in
`old_kernels_draft.py`: `git show d764bb9:dspark/kernels/draft.py`, its relative imports made `dspark.` ones (the
record `round_anatomy_gpu_before.json` ran that way). NAME names the JSON.
OUT=. [MICRO=1] [NAME=round_anatomy_gpu] python round_anatomy_gpu.py"""
import json, os, statistics, time, torch, dspark
import dspark.runtime.fused_round as FR
import dspark.kernels.draft as kd
import dspark.kernels.markov as km
from torch.profiler import profile, ProfilerActivity
from dspark.tools.bench import _default_model_prompts, decode_run, machine
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams

OUT, NAME = os.environ["OUT"], os.environ.get("NAME", "round_anatomy_gpu")
res = {"machine": machine()}

def ordered(fn, reps=5):
    "The kernels of one call of `fn` in launch order: [name, µs] (after warm-up; the median call of `reps`)."
    for _ in range(5): fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(reps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
        runs.append([[e.name[:70], round(e.device_time, 2)] for e in ev])
    runs.sort(key=lambda r: sum(t for _, t in r))
    return runs[len(runs) // 2]

def graphed(fn, n=20):
    "Capture `n` calls of `fn` in one CUDA graph; returns its replay."
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    return g.replay

def per_kernel_us(fn, n=20, reps=20):
    "Median per-launch device time (µs) of the kernels of `n` graphed calls, and the replay's wall time per call."
    replay = graphed(fn, n)
    for _ in range(5): replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps): replay()
        torch.cuda.synchronize()
    ks = [e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(reps): replay()
    b.record(); torch.cuda.synchronize()
    return {"kernel_us_per_call": round(sum(ks) / (n * reps), 2), "launches_per_call": len(ks) / (n * reps),
            "wall_us_per_call": round(a.elapsed_time(b) * 1000 / (n * reps), 2)}

# 1. the ordered anatomy of a round, a draft step and a decode step
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device="cuda", dtype="bfloat16", max_num_seqs=16,
                 max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
prompt = sweep_prompts(DEFAULT_MODEL, 1, 128)
out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
d = llm.runner.proposer.drafter
res["kernels_on"] = d.attn_kernel is not None and d.markov_kernel is not None
anat = {"round_1": llm.graphs.rounds.graphs[1][0].replay, "draft_1": llm.runner.proposer.graphs.graphs[1][0].replay,
        "decode_1": llm.graphs.graphs[1][0].replay}
res["anatomy"] = {k: ordered(fn) for k, fn in anat.items()}
for k, v in res["anatomy"].items(): print(k, len(v), "kernels", round(sum(t for _, t in v), 1), "us", flush=True)
res["tokens"] = out[0].outputs[0].token_ids
plain = dspark.LLM(DEFAULT_MODEL, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                   kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
plain.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
res["anatomy"]["decode_1_nospec"] = ordered(plain.graphs.graphs[1][0].replay)
print("decode_1_nospec", len(res["anatomy"]["decode_1_nospec"]), "kernels", flush=True)
del plain
json.dump(res, open(f"{OUT}/{NAME}.json", "w"), indent=1)

# 1b. the host's share: wait for the verification, then read -> next launch
marks = {"wait": [], "read_end": [], "launch_end": []}
read0, launch0 = FR.RoundGraphs.read, FR.RoundGraphs._replay   # every round's replay (laid out by the host or advanced)
def read(self, handle):
    t0 = time.perf_counter()
    if self.host is not None: self.event.synchronize()
    t1 = time.perf_counter()
    r = read0(self, handle)
    marks["wait"].append(t1 - t0); marks["read_end"].append(time.perf_counter())
    return r
def launch(self, *a, **k):
    h = launch0(self, *a, **k); marks["launch_end"].append(time.perf_counter()); return h
FR.RoundGraphs.read, FR.RoundGraphs._replay = read, launch
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
host = []
for _ in range(3):
    for v in marks.values(): v.clear()
    t = time.perf_counter(); llm.generate(prompt, sp, use_tqdm=False); wall = time.perf_counter() - t
    # launch k + 1 follows read k when the round was launched ahead (launch_next runs right after the read)
    path = [l - r for r, l in zip(marks["read_end"], marks["launch_end"][1:]) if 0 < l - r < 0.01]
    host.append({"wall_ms": round(wall * 1e3, 2), "rounds": len(marks["read_end"]),
                 "wait_us_median": round(statistics.median(marks["wait"]) * 1e6, 1),
                 "read_to_next_launch_us_median": round(statistics.median(path) * 1e6, 1) if path else None,
                 "read_to_next_launch_us_p90": round(sorted(path)[int(0.9 * len(path))] * 1e6, 1) if path else None,
                 "ms_per_round": round(1e3 * (marks["read_end"][-1] - marks["read_end"][0]) / max(1, len(marks["read_end"]) - 1), 4)})
FR.RoundGraphs.read, FR.RoundGraphs._replay = read0, launch0
res["host"] = host
def replay_ms(fn, n=200):
    for _ in range(10): fn()
    torch.cuda.synchronize(); a, b = torch.cuda.Event(True), torch.cuda.Event(True); a.record()
    for _ in range(n): fn()
    b.record(); torch.cuda.synchronize(); return round(a.elapsed_time(b) / n, 4)
res["replay_ms"] = {k: replay_ms(fn) for k, fn in anat.items()}
print("host", json.dumps(host), flush=True)
json.dump(res, open(f"{OUT}/{NAME}.json", "w"), indent=1)

# 2. the block attention, new against old, and the Markov loop by chunk, at the embedded model's shapes
cfg, dt, dev = d.cfg, torch.bfloat16, "cuda"
attn = d.mtp[0].attn
g = torch.Generator().manual_seed(0)
rnd = lambda *s: torch.randn(*s, generator=g).to(dev)
res["attention"], res["markov"] = {}, {}
if os.environ.get("MICRO"): import old_kernels_draft as old
for R in ((1, 16, 64) if os.environ.get("MICRO") else ()):
    H, Dh, G = attn.attn_sink.shape[0], cfg.head_dim, d.block_size
    q, ring, kv = rnd(R, G, H, Dh).to(dt), rnd(R, 2, 133, Dh).to(dt), rnd(R, G, Dh).to(dt)
    valid = (torch.rand(R, 133, generator=g) < 0.95).to(dev)
    sink, sc = attn.attn_sink, Dh ** -0.5
    a_new = kd.draft_block_attention(q, ring[:, 0], valid, kv, sink, sc)
    a_old = old.draft_block_attention(q, ring[:, 0], valid, kv, sink, sc)
    ref = kd.draft_block_attention_ref(q, ring[:, 0], valid, kv, sink, sc)
    row = {"max_err_new": (a_new - ref).abs().max().item(), "max_err_old": (a_old - ref).abs().max().item(),
           "new": per_kernel_us(lambda: kd.draft_block_attention(q, ring[:, 0], valid, kv, sink, sc)),
           "old": per_kernel_us(lambda: old.draft_block_attention(q, ring[:, 0], valid, kv, sink, sc))}
    res["attention"][R] = row
    print("attention", R, json.dumps(row), flush=True)
    V, rank = cfg.vocab_size, cfg.dspark_markov_rank
    mh = d.last.markov_head
    U, h, anchors = rnd(R, G, V) * 4, rnd(R, G, cfg.hidden_size).to(dt), torch.randint(0, V, (R,), device=dev)
    w1, w2, cw = mh.markov_w1.weight, mh.markov_w2.weight, d.last.confidence_head.proj.weight[0]
    ref_d, _ = km.markov_greedy_ref(U, h, anchors, w1, w2, cw, G)
    res["markov"][R] = {}
    for chunk in (512, 256, 128):
        dr, _ = km.markov_greedy_triton(U, h, anchors, w1, w2, cw, G, chunk=chunk)
        row = {"same_drafts": bool(torch.equal(dr, ref_d)),
               **per_kernel_us(lambda: km.markov_greedy_triton(U, h, anchors, w1, w2, cw, G, chunk=chunk), n=10)}
        res["markov"][R][chunk] = row
        print("markov", R, chunk, json.dumps(row), flush=True)
json.dump(res, open(f"{OUT}/{NAME}.json", "w"), indent=1)
del llm; torch.cuda.empty_cache()

# 3. decode at one request: no-spec and DSpark, 3 runs each
prompts = _default_model_prompts(DEFAULT_MODEL, 1, 128)
res["decode"] = []
for mode in ("none", "dspark", "none", "dspark"):
    r = decode_run(DEFAULT_MODEL, prompts[:1], None if mode == "none" else mode, 5 if mode == "dspark" else None, 128,
                   "cuda", "bfloat16", repeats=3)
    toks = r.pop("token_ids", None)
    res.setdefault("same_tokens", []).append(toks)
    res["decode"].append(r)
    print("decode", mode, r["tok_s"], r["tok_s_runs"], r["mean_acceptance_length"], r["decode_step_ms"], flush=True)
json.dump(res, open(f"{OUT}/{NAME}.json", "w"), indent=1)
res["same_tokens"] = all(t == res["same_tokens"][0] for t in res["same_tokens"])
print("greedy tokens identical across modes:", res["same_tokens"], flush=True)
json.dump(res, open(f"{OUT}/{NAME}.json", "w"), indent=1)
