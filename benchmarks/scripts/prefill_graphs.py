"""Prefill (ragged) CUDA graphs on the GPU: (A) graph vs eager greedy tokens and first-token logprobs for none / MTP /
DSpark on the default model, prompts longer than every ring; (B) the C1 A/B of no-spec vs DSpark with prefill graphs
on and off, in one process. OUT=. python prefill_graphs.py"""
import json, os, time, statistics, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "checks": {}, "ab": {}}
long = sweep_prompts(DEFAULT_MODEL, 6, 300)
prompts = [long[0], long[1][:128], long[2][:37]]
def engine(mode, eager=False, seqs=8):
    path = DEFAULT_MODEL / "mtp" if mode == "mtp" else DEFAULT_MODEL
    return dspark.LLM(path, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=seqs, max_model_len=1024,
                      kv_cache_memory_bytes=2**30, enable_prefix_caching=False, enforce_eager=eager)
# (A) correctness
for mode in (None, "mtp", "dspark"):
    outs = {}
    for eager in (False, True):
        llm = engine(mode, eager)
        sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
        lp = [llm.generate([p], SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0].outputs[0].logprobs[0]
              for p in long[3:6]]
        g = llm.graphs
        outs[eager] = dict(together=together, alone=alone, lp=lp,
                           eager_steps=g.eager_steps if g else None, replays=g.replays if g else None,
                           summary=g.summary() if g else None)
        del llm; torch.cuda.empty_cache()
    a, b = outs[False], outs[True]
    diff = max(abs(a["lp"][i][t] - b["lp"][i][t]) for i in range(3) for t in a["lp"][i] if t in b["lp"][i])
    res["checks"][str(mode)] = {"together_identical": a["together"] == b["together"],
                                "alone_identical": a["alone"] == b["alone"],
                                "first_token_top5_logprob_max_abs_diff": round(diff, 5),
                                "top1_same": all(max(x, key=x.get) == max(y, key=y.get) for x, y in zip(a["lp"], b["lp"])),
                                "graph_engine_eager_steps": a["eager_steps"], "graph_engine_replays": a["replays"],
                                "summary": a["summary"]}
    print(mode, json.dumps(res["checks"][str(mode)]), flush=True)
# (B) C1 A/B: prefill graphs on/off, no-spec vs DSpark
ab = sweep_prompts(DEFAULT_MODEL, 8, 128)
llms = {m: engine(m, seqs=16) for m in (None, "dspark")}
saved = {m: llms[m].graphs.ragged for m in llms}
def run(llm, prompt, n):
    llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), request_id="x")
    torch.cuda.synchronize(); t0 = time.perf_counter()
    llm.step(); torch.cuda.synchronize(); t1 = time.perf_counter()
    while llm.has_unfinished_requests(): llm.step()
    torch.cuda.synchronize(); t2 = time.perf_counter()
    llm.pop_output("x")
    return {"total_tok_s": n / (t2 - t0), "decode_tok_s": (n - 1) / (t2 - t1), "prefill_ms": 1e3 * (t1 - t0)}
for n in (96, 128):
    rows = {}
    for m in llms: run(llms[m], ab[0], 16)
    for rep in range(7):
        order = [(m, on) for m in llms for on in (True, False)]
        if rep % 2: order.reverse()
        for m, on in order:
            llms[m].graphs.ragged = saved[m] if on else {}
            rows.setdefault(f"{m or 'none'}_{'graphs' if on else 'eager'}_prefill", []).append(run(llms[m], ab[1 + rep], n))
    med = {k: {q: round(statistics.median(r[q] for r in v), 2) for q in v[0]} for k, v in rows.items()}
    med["ratio_dspark_vs_none_total"] = {on: round(med[f"dspark_{on}_prefill"]["total_tok_s"] / med[f"none_{on}_prefill"]["total_tok_s"], 3)
                                         for on in ("graphs", "eager")}
    med["ratio_per_pair_graphs"] = [round(b["total_tok_s"] / a["total_tok_s"], 3)
                                    for a, b in zip(rows["none_graphs_prefill"], rows["dspark_graphs_prefill"])]
    res["ab"][n] = med
    print(n, json.dumps(med), flush=True)
res["spec"] = llms["dspark"].spec_stats()
json.dump(res, open(f"{OUT}/prefill_graphs.json", "w"), indent=1)
