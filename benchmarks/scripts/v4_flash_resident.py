"""DeepSeek-V4-Flash at full width on one GPU, weights resident as stored (issue 39's on-device checks).

    python benchmarks/scripts/v4_flash_resident.py resident [--layers N]   # dummy weights, all 256 experts
    python benchmarks/scripts/v4_flash_resident.py write DIR --layers 3    # a written FP8/FP4 checkpoint ...
    python benchmarks/scripts/v4_flash_resident.py load DIR                # ... loaded cold from disk (own process)

`resident` builds the named config `deepseek-v4-flash` with `--load-format dummy --quantization auto`, as many
layers as the memory plan fits on this GPU (or N), compares the GPU memory the weights take with the stored bytes of
the tensors built, generates greedily, and prints the engine's profile lines. `write` makes random as-stored weights
on the GPU and writes them one shard per layer in the shipped layout; `load` evicts the files from the page cache,
times `dd` on the largest shard, then streams the checkpoint to the GPU with `load_target(..., quantization="auto")`
and reports its wall time, GB/s and the process's peak host memory. Each prints one JSON object (and writes it to
`$OUT/<command>.json` when OUT is set). `--tiny` shrinks the width for a CPU smoke run.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

TINY = {"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 8, "num_attention_heads": 4,
        "q_lora_rank": 128, "o_lora_rank": 128, "o_groups": 2, "index_n_heads": 4, "vocab_size": 129280}


def emit(name: str, res: dict) -> None:
    print(json.dumps(res, indent=1))
    if os.environ.get("OUT"): Path(os.environ["OUT"], f"{name}.json").write_text(json.dumps(res, indent=1) + "\n")


def byte_sum(t: torch.Tensor) -> int:
    "An exact checksum of a tensor's bytes (a float sum would depend on the device's summation order)."
    return int(t.contiguous().view(-1).view(torch.uint8).sum(dtype=torch.int64))


def peak_host_gib() -> float:
    "This process's peak resident set (Linux reports KiB)."
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def flash_config(layers: int, tiny: bool):
    from dspark.config import load_config, resolve_model
    return load_config(resolve_model("deepseek-v4-flash"), {"num_hidden_layers": layers, **(TINY if tiny else {})})


def layers_that_fit(total: int, max_len: int, seqs: int, tokens: int) -> int:
    "The most layers whose plan leaves KV for `seqs` requests of `max_len` at 0.92 of this GPU (eager: no graph pool)."
    from dspark.distributed.plan import plan_memory
    for n in range(43, 0, -1):
        p = plan_memory(flash_config(n, False), 1, total, 0.92, max_len, seqs, tokens, cuda_graphs=False)
        if p.kv_tokens >= max_len * seqs: return n
    raise SystemExit("not even one layer fits")


def resident(a) -> None:
    import dspark
    from dspark.distributed.plan import weight_bytes
    from dspark.model.weights import FP4Linear, FP8Linear, resident_bytes
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    total = torch.cuda.mem_get_info()[1] if dev == "cuda" else 0
    n = a.layers or layers_that_fit(total, a.max_model_len, a.seqs, a.tokens)
    over = {"num_hidden_layers": n, **(TINY if a.tiny else {})}
    t0 = time.perf_counter()
    llm = dspark.LLM(model="deepseek-v4-flash", load_format="dummy", quantization="auto", hf_overrides=over,
                     device=dev, dtype="bfloat16", enforce_eager=True, max_model_len=a.max_model_len,
                     max_num_seqs=a.seqs, max_num_batched_tokens=a.tokens, gpu_memory_utilization=0.92)
    built_s = time.perf_counter() - t0
    cfg, mem = llm.model.cfg, llm.engine.memory
    stored = weight_bytes(cfg)                       # the stored bytes of every tensor built (no drafter)
    held = resident_bytes(llm.model)
    mods = list(llm.model.modules())
    res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "layers": n, "experts": cfg.n_routed_experts, "hidden": cfg.hidden_size, "build_s": round(built_s, 1),
           "fp8_linears": sum(isinstance(m, FP8Linear) for m in mods),
           "fp4_linears": sum(isinstance(m, FP4Linear) for m in mods),
           "stored_bytes": stored, "state_dict_bytes": held,
           "gpu_weight_bytes": mem.weights if mem is not None else None,
           "gpu_over_stored": round(mem.weights / stored, 4) if mem is not None else None,
           "gpu_total_bytes": total, "profile": llm.engine.profile.splitlines()}
    sp = dspark.SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    for c in (1, a.seqs):
        prompts = [f"Request {i}: the quick brown fox jumps over the lazy dog" for i in range(c)]
        if dev == "cuda": torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        if dev == "cuda": torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        res[f"generate_c{c}"] = {"s": round(dt, 2), "tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                                 "finite_text": outs[0].outputs[0].text[:60]}
    if dev == "cuda": res["peak_gpu_bytes"] = torch.cuda.max_memory_allocated()
    res["peak_host_gib"] = round(peak_host_gib(), 2)
    emit("resident", res)


def write(a) -> None:
    from safetensors.torch import save_file
    from dspark.config import save_config
    from dspark.model.checkpoint import meta_target
    from dspark.model.weights import dummy_weights
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = flash_config(a.layers, a.tiny)
    out = Path(a.dir); out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = dummy_weights(meta_target(cfg, "bfloat16", "auto"), seed=1, device=dev)
    state = model.state_dict()
    shard_of = lambda k: int(k.split(".")[1]) + 1 if k.startswith("layers.") else 0   # one shard a layer, one for the rest
    n_shards = cfg.num_hidden_layers + 1
    weight_map, sums, total, largest = {}, {}, 0, 0
    for s in range(n_shards):
        keys = [k for k in state if shard_of(k) == s]
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {k: state[k].contiguous().cpu() for k in keys}
        save_file(part, out / name, metadata={"format": "pt"})
        size = sum(t.numel() * t.element_size() for t in part.values())
        total, largest = total + size, max(largest, (out / name).stat().st_size)
        weight_map.update({k: name for k in keys})
        for k in keys[:: max(1, len(keys) // 8)]:        # a few checksums a shard, checked after the load
            sums[k] = byte_sum(part[k])
        del part
    save_config(cfg, out)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "checksums.json").write_text(json.dumps(sums))
    emit("write", {"dir": str(out), "layers": cfg.num_hidden_layers, "shards": n_shards, "bytes": total,
                   "largest_shard_bytes": largest, "write_s": round(time.perf_counter() - t0, 1),
                   "peak_host_gib": round(peak_host_gib(), 2)})


def evict(path: Path) -> None:
    "Drop `path`'s pages from the page cache (flushed first), so the next read comes from the disk."
    fd = os.open(path, os.O_RDONLY)
    try: os.fsync(fd); os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally: os.close(fd)


def load(a) -> None:
    from dspark.model.checkpoint import load_target
    d = Path(a.dir)
    shards = sorted(d.glob("*.safetensors"))
    for p in shards: evict(p)
    big = max(shards, key=lambda p: p.stat().st_size)
    t0 = time.perf_counter()
    subprocess.run(["dd", f"if={big}", "of=/dev/null", "bs=16M"], check=True, capture_output=True)
    disk = big.stat().st_size / (time.perf_counter() - t0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda": torch.cuda.init(); torch.empty(1, device=dev)
    base = peak_host_gib()
    res = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "disk_read_GBps_dd_largest_shard": round(disk / 1e9, 2),
           "largest_shard_bytes": big.stat().st_size, "host_before_load_gib": round(base, 2)}
    import dspark.model.checkpoint as ck
    from dspark.model.reader import CheckpointReader
    for run in (a.runs or "cold,warm").split(","):   # cold: evicted first; warm: the files in the page cache
        direct = not run.endswith("_mmap")         # *_mmap: safetensors' memory-mapped reader, for comparison
        ck.CheckpointReader = lambda path, device="cpu": CheckpointReader(path, device, direct=direct)
        if run.startswith("cold"):
            for p in shards: evict(p)
        if dev == "cuda": torch.cuda.synchronize()
        t0 = time.perf_counter()
        model = load_target(d, dev, "bfloat16", quantization="auto", progress=False)
        if dev == "cuda": torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        res[run] = {"s": round(dt, 2), "bytes": nbytes, "GBps": round(nbytes / dt / 1e9, 2),
                    "peak_host_gib": round(peak_host_gib(), 2)}
        if run == "cold":
            sums, state = json.loads((d / "checksums.json").read_text()), model.state_dict()
            bad = [k for k, v in sums.items() if byte_sum(state[k]) != v]
            res["checksums_checked"], res["checksums_bad"] = len(sums), bad[:5]
        del model
        if dev == "cuda": torch.cuda.empty_cache()
    res["host_budget_gib"] = round(2 * big.stat().st_size / 2**30 + 4, 2)     # 2x the largest shard plus a few GiB
    res["within_budget"] = {r: v["peak_host_gib"] <= res["host_budget_gib"] for r, v in res.items()
                            if isinstance(v, dict) and "peak_host_gib" in v}
    emit(f"load_{a.runs.replace(',', '_')}" if a.runs else "load", res)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=("resident", "write", "load"))
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--tiny", action="store_true", help="a narrow config (CPU smoke run)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--runs", default="", help="load: comma-separated cold,warm,cold_mmap,warm_mmap (own process each for a fair peak)")
    a = ap.parse_args()
    {"resident": resident, "write": write, "load": load}[a.command](a)
