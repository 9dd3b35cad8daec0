"""Steps that carry arrivals kept on captured graphs, off and on: "off" is the engine before (graphs up to 512
tokens, nothing trimmed), "on" graphs up to RAGGED_GRAPH_TOKENS (2,048) with mixed steps trimmed to that size
(Scheduler.prefill_room). Under a steady load on the H200:
the bench's --waves 4 decode runs (128 tokens after 128-token held-out prompts, cycled when the machine's standard
library has fewer files) for no-spec and DSpark at 16 and 64 in flight, order rotated; greedy tokens compared.
OUT=. [CONC="16 64"] python mixed_steps_gpu.py"""
import json, os
import dspark.engine.core as E
import dspark.engine.scheduler as S
from dspark.tools.bench import _default_model_prompts, decode_run, machine
from dspark.model.checkpoint import DEFAULT_MODEL
OUT = os.environ["OUT"]
room = S.Scheduler.prefill_room
def trim(on: bool) -> None:
    S.Scheduler.prefill_room = room if on else (lambda self, admit: self.sc.max_num_batched_tokens)
    E.RAGGED_GRAPH_TOKENS = 2048 if on else 512
res = {"machine": machine(), "runs": []}
CONC = [int(c) for c in os.environ.get("CONC", "16 64").split()]
pool = _default_model_prompts(DEFAULT_MODEL, 4 * max(CONC), 128)
res["distinct_prompts"] = len(pool)
pool = [pool[i % len(pool)] for i in range(4 * max(CONC))]
variants = [("none", False), ("none", True), ("dspark", False), ("dspark", True)]
for i, c in enumerate(CONC):
    rows = {}
    for mode, on in variants[i:] + variants[:i]:
        trim(on)
        r = decode_run(DEFAULT_MODEL, pool[:4 * c], None if mode == "none" else mode, 5 if mode != "none" else None,
                       128, "cuda", "bfloat16", repeats=int(os.environ.get("REPEATS", 3)), concurrency=c)
        rows[(mode, on)] = r
        print(f"C{c} {mode} trim={on}: {r['tok_s']} tok/s runs {r['tok_s_runs']} acceptance {r['mean_acceptance_length']} "
              f"step {r['decode_step_ms']} ms steps {r['steps']}", flush=True)
    for (mode, on), r in rows.items():
        out = {k: v for k, v in r.items() if k != "token_ids"} | {"trim": on}
        out["same_tokens_as_untrimmed"] = sum(a == b for a, b in zip(r["token_ids"], rows[(mode, False)]["token_ids"]))
        out["over_none_same_trim"] = round(r["tok_s"] / rows[("none", on)]["tok_s"], 3)
        res["runs"].append(out)
    json.dump(res, open(f"{OUT}/mixed_steps_gpu.json", "w"), indent=1)
trim(True)
