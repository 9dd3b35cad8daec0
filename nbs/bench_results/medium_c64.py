"""The medium preset at 64 requests against transformers (H200; 64 tokens after 128-token random prompts): dspark bf16
and transformers fp32, plus dspark fp32 at 16 requests for the greedy-token comparison with transformers; one run.
OUT=. python medium_c64.py"""
import json, os, tempfile, torch, dspark
from dspark.tools.bench import decode_run, hf_decode_run
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
g = torch.Generator().manual_seed(0)
pool = torch.randint(2, 32768, (64, 128), generator=g).tolist()
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": []}
def emit(tag, r):
    r = {k: v for k, v in r.items() if k != "token_ids"} | {"tag": tag}
    print(json.dumps(r), flush=True); res["runs"].append(r)
    json.dump(res, open(os.environ["OUT"] + "/medium_c64.json", "w"), indent=1)
emit("ours_bf16_c64", decode_run(path, pool, None, None, 64, "cuda", "bfloat16", kv_bytes=2**31))
base = hf_decode_run(path, pool, 64, "cuda")
base.pop("token_ids"); emit("hf_fp32_c64", base)
ours = decode_run(path, pool[:16], None, None, 64, "cuda", "float32", kv_bytes=2**31)
hf16 = hf_decode_run(path, pool[:16], 64, "cuda")
emit("ours_fp32_c16", ours)
emit("hf_fp32_c16", hf16 | {"greedy_identical_to_ours_fp32": sum(a == b for a, b in zip(hf16.pop("token_ids"), ours["token_ids"]))})
