"""Host cost of launching a captured step (H200, default model, bf16): wall time of `graph.replay()` on the host alone
(no sync after it) and of the replay through to completion, for the no-spec decode graph and the DSpark round, C1.
OUT=. python replay_host.py"""
import json, os, statistics, time, torch, dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
for mode in (None, "dspark"):
    llm = dspark.LLM(DEFAULT_MODEL, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                     kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    llm.generate([list(range(5, 133))], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    g = llm.graphs
    graphs = {"decode_1": g.graphs[1][0]} if mode is None else {"round_1": g.rounds.graphs[1][0], "decode_1": g.graphs[1][0]}
    out = {}
    for name, graph in graphs.items():
        launch, total = [], []
        for _ in range(200):
            torch.cuda.synchronize(); t0 = time.perf_counter(); graph.replay(); t1 = time.perf_counter()
            torch.cuda.synchronize(); t2 = time.perf_counter()
            launch.append(t1 - t0); total.append(t2 - t0)
        out[name] = {"launch_us": round(1e6 * statistics.median(launch), 1), "launch_to_done_us": round(1e6 * statistics.median(total), 1)}
    res[mode or "none"] = out; print(mode, out, flush=True)
    del llm; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/replay_host.json", "w"), indent=1)
