"""Overlapped greedy decoding (chapter 25) on and off, on the same medium engine settings as chapter 35's bench
(bf16, graphs, 128 greedy tokens after 128-token random prompts), run one after the other at 1 and 256 requests:
tok/s (median of 3 end-to-end runs), the synced step, steps computed ahead and used, and whether the tokens are
identical. OUT=. python overlap_gpu.py"""
import json, os, sys, tempfile, torch, dspark
from dspark.tools.bench import decode_run, machine
path = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
pool = torch.randint(2, 32768, (256, 128), generator=torch.Generator().manual_seed(0)).tolist()
res = {"machine": machine(), "runs": []}
for c in [int(x) for x in sys.argv[1:]] or [1, 256]:
    pair = {}
    for overlap in (False, True):
        r = decode_run(path, pool[:c], None, None, 128, "cuda", "bfloat16", overlap=overlap)
        pair[overlap] = r
        row = {k: v for k, v in r.items() if k != "token_ids"}
        res["runs"].append(row); print(json.dumps(row), flush=True)
    res.setdefault("identical", {})[c] = sum(a == b for a, b in zip(pair[False]["token_ids"], pair[True]["token_ids"]))
    res.setdefault("speedup", {})[c] = round(pair[True]["tok_s"] / pair[False]["tok_s"], 3)
    print(c, "identical", res["identical"][c], "/", c, "speedup", res["speedup"][c], flush=True)
    json.dump(res, open(os.environ.get("OUT", ".") + "/overlap_gpu.json", "w"), indent=1)
