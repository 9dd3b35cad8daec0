"The medium preset's decode and transformers' baseline, printed as each piece finishes (the same prompts and functions as python -m dspark.bench --model medium --modes none --concurrency 1 16 --max-tokens 64 --hf-baseline 1 16). Run on a GPU: OUT=. python medium_fused.py"
import json, os, tempfile, torch, dspark
from dspark.tools.bench import decode_run, hf_decode_run
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
g = torch.Generator().manual_seed(0)
pool = torch.randint(2, 32768, (16, 128), generator=g).tolist()
out = open(os.environ["OUT"] + "/medium_inc.jsonl", "w")
def emit(tag, r):
    r = {k: v for k, v in r.items() if k != "token_ids"} | {"tag": tag}
    print(json.dumps(r), flush=True); out.write(json.dumps(r) + "\n"); out.flush()
for c in (1, 16):
    ours_bf = decode_run(path, pool[:c], None, None, 64, "cuda", "bfloat16", kv_bytes=2**31)
    emit(f"bf16_c{c}", ours_bf)
    base = hf_decode_run(path, pool[:c], 64, "cuda")
    ours = decode_run(path, pool[:c], None, None, 64, "cuda", "float32", kv_bytes=2**31)
    same = sum(a == b for a, b in zip(base.pop("token_ids"), ours["token_ids"]))
    emit(f"hf_c{c}", base | {"ours_fp32_tok_s": ours["tok_s"], "greedy_identical": same})
