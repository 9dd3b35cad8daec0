"""The medium preset at 256 requests, past the bench's largest concurrency: dspark bf16 against transformers' bf16
generate (autocast), the bench's settings (128 greedy tokens after 128-token random prompts, seed 0). One run.
OUT=. python medium_c256.py"""
import json, os, tempfile, torch, dspark
from dspark.tools.bench import decode_run, hf_decode_run
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
pool = torch.randint(2, 32768, (256, 128), generator=torch.Generator().manual_seed(0)).tolist()
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
ours = decode_run(path, pool, None, None, 128, "cuda", "bfloat16", kv_bytes=4 * 2**30)
res["ours_bf16"] = {k: v for k, v in ours.items() if k != "token_ids"}
print(json.dumps(res["ours_bf16"]), flush=True)
hf = hf_decode_run(path, pool, 128, "cuda", "bfloat16")
res["hf_bf16"] = {k: v for k, v in hf.items() if k != "token_ids"} | {"ratio": round(ours["tok_s"] / hf["tok_s"], 2)}
print(json.dumps(res["hf_bf16"]), flush=True)
json.dump(res, open(os.environ["OUT"] + "/medium_c256.json", "w"), indent=1)
