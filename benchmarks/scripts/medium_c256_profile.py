"""Where a large-batch medium decode step goes (H200, bf16, graphs): kernels and wall time per replay of the
256-, 64- and 1-token decode graphs, replayed on the layout of the last real step of a 256-request batch (256
requests at ~140 positions each). OUT=. python medium_c256_profile.py"""
import json, os, tempfile, torch, dspark
from dspark.sample.sampling import SamplingParams
from round_profile_lib import ev_time, kernels
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
pool = torch.randint(2, 32768, (256, 128), generator=torch.Generator().manual_seed(0)).tolist()
llm = dspark.LLM(path, device="cuda", dtype="bfloat16", max_num_seqs=256, max_model_len=512,
                 kv_cache_memory_bytes=2**31, enable_prefix_caching=False)
llm.generate(pool, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
for n in (256, 64, 1):
    fn = llm.graphs.graphs[next(s for s in llm.graphs.sizes if s >= n)][0].replay
    res[f"decode_{n}"] = {"wall_ms": round(ev_time(fn), 4), **kernels(fn, 20)}
    print(n, json.dumps(res[f"decode_{n}"])[:2500], flush=True)
json.dump(res, open(os.environ["OUT"] + "/medium_c256_profile.json", "w"), indent=1)
