"""GPU checks of the device sampler (chapter 16): the compiled kernels against the CPU torch reference at the V4
vocabulary, and seeded sampled tokens with CUDA graphs against `enforce_eager=True` (tiny, fp32) for no-spec,
MTP and DSpark. Writes $OUT/sampled_checks.json."""
import json, os, tempfile
import torch, dspark
from dspark.sample.sampling import SamplingParams, draw_keyed, keyed_uniforms

OUT = os.environ["OUT"]
res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
V, M = 129280, 8
g = torch.Generator().manual_seed(0)
seed = torch.tensor([0, 1, -5, 2**62, 123456789, -2**63, 7, 99])
pos = torch.tensor([0, 5, 2**33 + 7, 100, 3, 9, 2**31 - 1, 4096])
st = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
u_cpu = keyed_uniforms(seed, pos, st, V)
u_gpu = keyed_uniforms(seed.cuda(), pos.cuda(), st.cuda(), V).cpu()
res["uniforms_bit_identical"] = bool(torch.equal(u_cpu, u_gpu))
w = (torch.randn(M, V, generator=g) * 3).softmax(-1)
d_cpu, d_gpu = draw_keyed(w, seed, pos, st), draw_keyed(w.cuda(), seed.cuda(), pos.cuda(), st.cuda()).cpu()
res["draws_equal_cpu_reference"] = f"{int((d_cpu == d_gpu).sum())}/{M}"
for name, drafter, spec in (("none", None, None), ("mtp", "mtp", "mtp"), ("dspark", "dspark", "dspark")):
    ck = dspark.make_tiny_checkpoint(tempfile.mkdtemp() + "/t", preset="tiny", seed=0, drafter=drafter)
    prompts = torch.randint(2, 512, (6, 24), generator=g).tolist()
    sps = [SamplingParams(temperature=[1.0, 0.7, 0.0][i % 3], top_k=[-1, 20, -1][i % 3], top_p=[1.0, 0.9, 1.0][i % 3],
                          max_tokens=20, seed=i, ignore_eos=True) for i in range(6)]
    outs = {}
    for eager in (False, True):
        llm = dspark.LLM(ck, speculative=spec, device="cuda", dtype="float32", enforce_eager=eager, max_num_seqs=8,
                         max_model_len=256, kv_cache_memory_bytes=2**28)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sps, use_tqdm=False)]
        if not eager: replays = llm.graphs.replays
    res[f"graphs_equal_eager_{name}"] = outs[False] == outs[True]
    res[f"graph_replays_{name}"] = replays
print(json.dumps(res, indent=1))
json.dump(res, open(f"{OUT}/sampled_checks.json", "w"), indent=1)
