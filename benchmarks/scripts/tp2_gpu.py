"TP=2 on two GPUs (NCCL): greedy identity with TP=1 for none/mtp/dspark (tiny fp32), logits, default model bf16 throughput, torchrun env://."
import json, os, socket, subprocess, sys, tempfile, time, torch, dspark
def main():
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.sample.sampling import SamplingParams
    from dspark.tools.records import split_raw, write_record
    out = os.environ.get("OUT"); res = {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())], "torch": torch.__version__}
    KV = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=64 * 2**20, device="cuda")
    SP = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60))]
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]
    tmp = tempfile.mkdtemp()
    for drafter in ("dspark", "mtp"):
        ck = dspark.make_tiny_checkpoint(f"{tmp}/{drafter}", preset="tiny", seed=0, drafter=drafter)
        ref = ids(dspark.LLM(ck, **KV).generate(PROMPTS, SP, use_tqdm=False))
        modes = ("none", drafter)
        for m in modes:
            if f"tiny_{m}" in res: continue
            t0 = time.time()
            llm = dspark.LLM(ck, speculative=None if m == "none" else m, num_speculative_tokens=None if m == "none" else 3,
                             tensor_parallel_size=2, **KV)
            got = ids(llm.generate(PROMPTS, SP, use_tqdm=False))
            r = {"identical": got == ref, "drafts": llm.spec_stats().get("num_drafts") if m != "none" else None, "s": round(time.time() - t0, 1)}
            if m == "none":
                x = torch.tensor([PROMPTS[1]])
                r["max_logit_err"] = (llm.logits(x) - dspark.load_target(ck).logits(x)).abs().max().item()
            llm.close(); res[f"tiny_{m}"] = r; print(m, r, flush=True)
    # default model bf16: TP=1 vs TP=2 dspark, C1 and C16
    from dspark.tools.capacity_sweep import sweep_prompts
    prompts = sweep_prompts(DEFAULT_MODEL, 16, 128)
    for tp in (1, 2):
        llm = dspark.LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=5, device="cuda", dtype="bfloat16", tensor_parallel_size=tp,
                         max_num_seqs=16, max_model_len=256, kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        for c in (1, 16):
            t0 = time.perf_counter(); o = llm.generate(prompts[:c], SamplingParams(temperature=0, max_tokens=96, ignore_eos=True), use_tqdm=False)
            dt = time.perf_counter() - t0
            res[f"default_tp{tp}_c{c}"] = {"tok_s": round(sum(len(x.outputs[0].token_ids) for x in o) / dt, 1), "tokens": ids(o)}
            print(tp, c, res[f"default_tp{tp}_c{c}"]["tok_s"], flush=True)
        llm.close()
    for c in (1, 16):
        a, b = res[f"default_tp1_c{c}"]["tokens"], res[f"default_tp2_c{c}"]["tokens"]
        res[f"default_c{c}_identical_requests"] = f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"
        print("bf16 identical", c, res[f"default_c{c}_identical_requests"], flush=True)
    # torchrun-style env:// with NCCL
    with socket.socket() as s: s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    ck = f"{tmp}/dspark"
    cmd = [sys.executable, "-m", "dspark.distributed.tp", "--model", ck, "--tensor-parallel-size", "2", "--device", "cuda",
           "--prompt-ids", json.dumps(PROMPTS), "--max-tokens", "12", "--ignore-eos", "--speculative", "dspark"]
    ps = [subprocess.Popen(cmd, env={**os.environ, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                     "MASTER_PORT": str(port)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=300) for p in ps]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    ref = ids(dspark.LLM(ck, **KV).generate(PROMPTS, SP, use_tqdm=False))
    res["torchrun_env_nccl"] = {"rc": [p.returncode for p in ps], "identical": [g["token_ids"] for g in got] == ref}
    print("env://", res["torchrun_env_nccl"], outs[0][1][-500:], flush=True)
    write_record("tp2_gpu", command="python benchmarks/scripts/tp2_gpu.py", folder=out, **split_raw(res))

if __name__ == '__main__': main()
