"""The draft step's Triton kernels (chapter 17) on the H200 with the embedded model, off and on in one run: kernels
and replay time of the greedy draft graph and the fused DSpark round (1 and 16 requests), then decode throughput of
no-spec and of DSpark with the kernels on and off at 1 / 4 / 16 / 64 requests (128 greedy tokens after 128-token
held-out prompts; 256 tokens too at one request), the order rotated per concurrency, greedy tokens compared.
OUT=. python draft_kernels_gpu.py"""
import json, os, torch, dspark
import dspark.runtime.graphs as G
from dspark.tools.bench import _default_model_prompts, decode_run, machine
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.kernels.draft import draft_kernels_check
from dspark.sample.sampling import SamplingParams
from round_profile_lib import ev_time, kernels

OUT = os.environ["OUT"]
full_path = G.fast_path
def torch_draft_path(model):
    "`fast_path` without chapter 17's kernels: the drafter keeps its torch attention and Markov loop."
    mhc = full_path(model)
    if hasattr(model, "markov_kernel"): model.attn_kernel = model.markov_kernel = None
    return mhc
def use_kernels(on: bool) -> None: G.fast_path = full_path if on else torch_draft_path

res = {"machine": machine(), "profile": {}, "decode": []}
prompt = sweep_prompts(DEFAULT_MODEL, 1, 128)
for on in (False, True):
    use_kernels(on)
    llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device="cuda", dtype="bfloat16", max_num_seqs=16,
                     max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    d = llm.runner.proposer.drafter
    if on:                                  # graphs.fast_path switched them on only if this found nothing wrong
        res["check"] = draft_kernels_check(d)
        print("draft_kernels_check:", res["check"] or "passed", flush=True)
    assert (d.markov_kernel is not None) == (on and res["check"] is None), "the switch did not take"
    rounds = llm.graphs.rounds.graphs
    targets = {"draft_1": llm.runner.proposer.graphs.graphs[1][0].replay, "round_1": rounds[1][0].replay,
               "round_16": rounds[16][0].replay}
    prof = {name: {"wall_ms": round(ev_time(fn), 4), **kernels(fn)} for name, fn in targets.items()}
    prof["tokens"] = out[0].outputs[0].token_ids
    prof["spec"] = llm.spec_stats()
    res["profile"]["on" if on else "off"] = prof
    print("kernels", on, json.dumps({k: (v if k in ("tokens", "spec") else {kk: vv for kk, vv in v.items() if kk != "top"})
                                     for k, v in prof.items()}), flush=True)
    del llm; torch.cuda.empty_cache()
res["profile"]["same_tokens"] = res["profile"]["on"]["tokens"] == res["profile"]["off"]["tokens"]

prompts = _default_model_prompts(DEFAULT_MODEL, 64, 128)
variants = [("none", None, True), ("dspark", "dspark", True), ("dspark_torch_draft", "dspark", False)]
for i, (c, n) in enumerate([(1, 128), (4, 128), (16, 128), (64, 128), (1, 256)]):
    rows = {}
    for name, mode, on in variants[i % 3:] + variants[:i % 3]:
        if n == 256 and name == "dspark_torch_draft": continue
        use_kernels(on)
        r = decode_run(DEFAULT_MODEL, prompts[:c], mode, 5 if mode else None, n, "cuda", "bfloat16", repeats=3)
        rows[name] = r
        print(f"C{c} {n} tokens {name}: {r['tok_s']} tok/s runs {r['tok_s_runs']} acceptance {r['mean_acceptance_length']} "
              f"step {r['decode_step_ms']} ms", flush=True)
    same = lambda a, b: sum(x == y for x, y in zip(rows[a]["token_ids"], rows[b]["token_ids"])) if a in rows and b in rows else None
    for name, r in rows.items():
        r = {k: v for k, v in r.items() if k != "token_ids"}
        r.update(variant=name, max_tokens=n)
        if name != "none": r["over_none"] = round(r["tok_s"] / rows["none"]["tok_s"], 3)
        res["decode"].append(r)
    res["decode"][-1]["identical"] = {"dspark_vs_torch_draft": same("dspark", "dspark_torch_draft"),
                                      "dspark_vs_none": same("dspark", "none"), "of": c}
    print("identical", res["decode"][-1]["identical"], flush=True)
    json.dump(res, open(f"{OUT}/draft_kernels_gpu.json", "w"), indent=1)
use_kernels(True)
json.dump(res, open(f"{OUT}/draft_kernels_gpu.json", "w"), indent=1)
