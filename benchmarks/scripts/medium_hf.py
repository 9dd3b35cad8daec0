"""The medium preset's decode against transformers' generate on the same weights and prompts (H200): ours in bf16 and
fp32 with CUDA graphs, transformers in fp32 (its bf16 run fails in 5.17: a float32 hidden state meets bf16 weights,
recorded below), 64 greedy tokens after 128-token random prompts, at concurrency 1 and 16 (and ours in fp32 at 1); one run, printed as
each piece finishes. OUT=. python medium_hf.py"""
import json, os, tempfile, torch, dspark
from dspark.tools.bench import decode_run, hf_decode_run
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
g = torch.Generator().manual_seed(0)
pool = torch.randint(2, 32768, (64, 128), generator=g).tolist()
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
def emit(tag, r):
    r = {k: v for k, v in r.items() if k != "token_ids"} | {"tag": tag}
    print(json.dumps(r), flush=True); res["runs"].append(r)
    json.dump(res, open(os.environ["OUT"] + "/medium_hf.json", "w"), indent=1)
try: hf_decode_run(path, pool[:1], 4, "cuda", "bfloat16")
except Exception as e: res["hf_bf16"] = f"{type(e).__name__}: {str(e)[:200]}"
for c in (1, 16):
    emit(f"ours_bf16_c{c}", ours := decode_run(path, pool[:c], None, None, 64, "cuda", "bfloat16", kv_bytes=2**31))
    base = hf_decode_run(path, pool[:c], 64, "cuda")
    emit(f"hf_fp32_c{c}", base | {"greedy_identical_to_ours_bf16": sum(a == b for a, b in zip(base.pop("token_ids"), ours["token_ids"]))})
ours = decode_run(path, pool[:1], None, None, 64, "cuda", "float32", kv_bytes=2**31)
emit("ours_fp32_c1", ours)
