"""The next round laid out on the device (chapter 23's `advance_layout`) against the host's `fill_layout`, at one
request on the GPU: the embedded model, bf16, graphs, as `python -m dspark.bench` builds it. Three arms in one
process, alternated: no-spec, DSpark with the advance (the default), DSpark with it switched off. Per arm: tok/s of
`REPEATS` runs (128 tokens after a 128-token prompt, prefill included, as the bench's C1 row), the rounds advanced,
and the host's time in `RoundAhead.launch_next` (perf_counter). OUT=. python advance_gpu.py"""
import collections, json, os, statistics, time, torch, dspark
import dspark.runtime.overlap as OV
from dspark.tools.bench import _default_model_prompts, frozen_heap
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams

OUT, REPEATS, PROMPTS = os.environ["OUT"], int(os.environ.get("REPEATS", 9)), int(os.environ.get("PROMPTS", 3))
prompts = _default_model_prompts(DEFAULT_MODEL, PROMPTS, 128)
sp = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
make = lambda mode: dspark.LLM(DEFAULT_MODEL, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=1,
                               max_num_batched_tokens=8192, max_model_len=128 + 128 + 13, enable_prefix_caching=False,
                               kv_cache_memory_bytes=2**30)
llms = {"none": make(None), "dspark": make("dspark"), "dspark_host_layout": make("dspark")}
rounds = llms["dspark_host_layout"].runner.round_ahead.rounds
rounds.can_advance = lambda *a: False                     # this arm lays every round out on the host, as before
spent = collections.defaultdict(list)
launch_next = OV.RoundAhead.launch_next
def timed(self, *a, **k):
    t = time.perf_counter(); launch_next(self, *a, **k); spent[self.arm].append(time.perf_counter() - t)
OV.RoundAhead.launch_next = timed
for arm, llm in llms.items():
    if llm.runner.round_ahead is not None: llm.runner.round_ahead.arm = arm
    for p in prompts: llm.generate([p], sp, use_tqdm=False)     # warm
runs, toks = collections.defaultdict(list), collections.defaultdict(list)
advanced0 = {a: llm.runner.round_ahead.rounds.advanced for a, llm in llms.items() if llm.runner.round_ahead}
spent.clear()
with frozen_heap():
    for rep in range(REPEATS):
        order = list(llms) if rep % 2 == 0 else list(llms)[::-1]
        for arm in order:
            p = prompts[rep % len(prompts)]
            torch.cuda.synchronize(); t = time.perf_counter()
            out = llms[arm].generate([p], sp, use_tqdm=False)
            torch.cuda.synchronize(); wall = time.perf_counter() - t
            ids = out[0].outputs[0].token_ids
            runs[arm].append(len(ids) / wall); toks[arm].append(ids)
med = {a: statistics.median(v) for a, v in runs.items()}
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "repeats": REPEATS,
       "tok_s": {a: round(v, 1) for a, v in med.items()}, "tok_s_runs": {a: [round(x, 1) for x in v] for a, v in runs.items()},
       "ratio_vs_none": {a: round(med[a] / med["none"], 3) for a in med if a != "none"},
       "advance_vs_host_layout": round(med["dspark"] / med["dspark_host_layout"], 3),
       "pairs_vs_none": {a: [round(x / y, 3) for x, y in zip(runs[a], runs["none"])] for a in med if a != "none"},
       "identical_tokens_advance_vs_host_layout": toks["dspark"] == toks["dspark_host_layout"],
       "identical_tokens_vs_none": {a: toks[a] == toks["none"] for a in toks if a != "none"},
       "rounds_advanced": {a: llm.runner.round_ahead.rounds.advanced - advanced0[a] for a, llm in llms.items() if llm.runner.round_ahead},
       "rounds_replayed": {a: llm.runner.round_ahead.rounds.replays for a, llm in llms.items() if llm.runner.round_ahead},
       "launch_next_us": {a: [len(v), round(statistics.median(v) * 1e6, 1)] for a, v in spent.items()},
       "spec": {a: llm.spec_stats() for a, llm in llms.items() if a != "none"}}
print(json.dumps({k: v for k, v in res.items() if k != "spec"}, indent=1), flush=True)
json.dump(res, open(f"{OUT}/{os.environ.get('NAME', 'advance_gpu')}.json", "w"), indent=1)
