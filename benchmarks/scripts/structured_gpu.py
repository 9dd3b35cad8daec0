"""Structured outputs under DSpark on the embedded model: decode tok/s at C1 and C16 with a JSON schema (nested
objects, enums, arrays) against the same prompts without one, at T = 0 and 1, and the mean acceptance length with
grammar-masked drafting on and off (`DSPARK_MASKED_DRAFTS`; here the runner's `masked_drafts`, switched in one engine).

    OUT=dir python benchmarks/scripts/structured_gpu.py                      # CUDA, bf16, graphs; ~2 minutes
    OUT=dir python benchmarks/scripts/structured_gpu.py --device cpu --quick  # a smoke run on the CPU

Each cell: C requests (128-token prompts from held-out standard-library files, request i seeded with i), max_tokens
128 (32 with --quick), ignore_eos off, timed after a warm-up of the same cell; tok/s counts generated tokens over
the wall time of the `generate` call. Writes $OUT/structured_gpu.json (structured_cpu.json on the CPU)."""
import argparse, json, os, tempfile, time

import torch

import dspark
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.tools.records import write_record

SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
    "status": {"enum": ["open", "closed", "pending"]},
    "owner": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "role": {"enum": ["admin", "user", "guest"]}},
              "required": ["name", "role"], "additionalProperties": False},
    "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "qty": {"type": "integer", "minimum": 1, "maximum": 9},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
        "required": ["sku", "qty", "tags"], "additionalProperties": False}},
    "ok": {"type": "boolean"}},
    "required": ["id", "status", "owner", "items", "ok"], "additionalProperties": False}

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda")
ap.add_argument("--quick", action="store_true", help="C1 and C4, 32 tokens: a smoke run")
args = ap.parse_args()
cuda = args.device.startswith("cuda")
CS, N = ((1, 4), 32) if args.quick else ((1, 16), 128)
prompts = sweep_prompts(DEFAULT_MODEL, max(CS), 128)
llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", device=args.device, dtype="bfloat16" if cuda else "float32",
                 max_num_seqs=max(CS), max_model_len=512, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
sync = torch.cuda.synchronize if cuda else (lambda: None)

def run(c: int, temp: float, schema: bool, n: int) -> dict:
    sp = [SamplingParams(temperature=temp, max_tokens=n, seed=i, structured_outputs={"json": SCHEMA} if schema else None)
          for i in range(c)]
    before = llm.spec_stats()
    sync(); t0 = time.perf_counter()
    outs = llm.generate(prompts[:c], sp, use_tqdm=False)
    sync(); wall = time.perf_counter() - t0
    after = llm.spec_stats()
    d, a = (after[k] - before[k] for k in ("num_drafts", "num_accepted_tokens"))
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = sum(o.outputs[0].finish_reason == "stop" and _valid(o.outputs[0].text) for o in outs) if schema else None
    return {"tokens": toks, "wall_s": round(wall, 4), "tok_s": round(toks / wall, 1), "num_drafts": d,
            "num_accepted_tokens": a, "mean_acceptance_length": round(1 + a / d, 3) if d else None,
            "valid_json": valid, "finished_stop": sum(o.outputs[0].finish_reason == "stop" for o in outs)}

def _valid(text: str) -> bool:
    try: json.loads(text); return True
    except ValueError: return False

rows = []
for c in CS:
    for temp in (0.0, 1.0):
        for mode in ("no_schema", "schema_masked", "schema_unmasked"):
            llm.runner.masked_drafts = mode != "schema_unmasked"
            run(c, temp, mode != "no_schema", 16)                    # warm-up: graphs, grammar compile, caches
            row = {"C": c, "temperature": temp, "mode": mode, **run(c, temp, mode != "no_schema", N)}
            rows.append(row); print(json.dumps(row), flush=True)
llm.runner.masked_drafts = True
for c in CS:
    for temp in (0.0, 1.0):
        r = {x["mode"]: x for x in rows if x["C"] == c and x["temperature"] == temp}
        print(f"C{c} T{temp}: schema/no-schema tok/s {r['schema_masked']['tok_s'] / r['no_schema']['tok_s']:.3f}; "
              f"acceptance masked {r['schema_masked']['mean_acceptance_length']} vs unmasked "
              f"{r['schema_unmasked']['mean_acceptance_length']} (no schema {r['no_schema']['mean_acceptance_length']})")
name = "structured_gpu" if cuda else "structured_cpu"
cmd = "python benchmarks/scripts/structured_gpu.py" + ("" if cuda else f" --device {args.device}") + (" --quick" if args.quick else "")
path = write_record(name, rows, cmd, {"model": "default", "speculative": "dspark", "device": args.device,
                                      "dtype": "bfloat16" if cuda else "float32", "max_tokens": N, "prompt_len": 128,
                                      "concurrency": list(CS), "schema": SCHEMA, "ignore_eos": False},
                    folder=os.environ.get("OUT", tempfile.gettempdir()))
print("wrote", path)
