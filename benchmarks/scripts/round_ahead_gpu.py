"""DSpark rounds launched ahead (chapter 25's RoundAhead) on and off, with the embedded model on the H200 (bf16,
graphs, 128 greedy tokens after 128-token held-out prompts, K = 5): tokens identical, rounds launched ahead and
used, tok/s. OUT=. python round_ahead_gpu.py"""
import json, os
from dspark.tools.bench import _default_model_prompts, decode_run, machine
from dspark.model.checkpoint import DEFAULT_MODEL
pool = _default_model_prompts(DEFAULT_MODEL, 16, 128)
res = {"machine": machine(), "runs": [], "identical": {}}
for c in (1, 16):
    toks = {}
    for overlap in (False, True):
        r = decode_run(DEFAULT_MODEL, pool[:c], "dspark", 5, 128, "cuda", "bfloat16", overlap=overlap)
        toks[overlap] = r.pop("token_ids"); res["runs"].append(r); print(json.dumps(r), flush=True)
    res["identical"][c] = sum(a == b for a, b in zip(toks[False], toks[True]))
    print(c, "identical", res["identical"][c], flush=True)
json.dump(res, open(os.environ.get("OUT", ".") + "/round_ahead_gpu.json", "w"), indent=1)
