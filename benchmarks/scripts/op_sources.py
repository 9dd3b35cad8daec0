"""Which source lines launch the kernels of a C1 step (H200, bf16): the captured step's function run eagerly under a
dispatch mode that charges each aten op (views and allocations left out; Triton launches are not aten ops) to its
innermost dspark frames; for the default model (no-spec decode, DSpark verify-6 and draft step) and the medium
preset. OUT=. python op_sources.py"""
import collections, json, os, tempfile, traceback, torch, dspark
from torch.utils._python_dispatch import TorchDispatchMode
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.sample.sampling import SamplingParams
OUT = os.environ["OUT"]; res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
SKIP = {"empty", "empty_strided", "empty_like", "detach", "lift_fresh", "_unsafe_view", "set_", "new_empty"}

class Sources(TorchDispatchMode):
    def __init__(self):
        super().__init__(); self.agg = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in SKIP:
            fr = [f for f in traceback.extract_stack() if "/dspark/" in f.filename]
            self.agg[f"{name} @ " + " < ".join(f"{f.filename.split('/dspark/')[-1]}:{f.lineno}" for f in fr[-3:][::-1])] += 1
        return func(*args, **(kwargs or {}))

def sources(fn):
    fn(); torch.cuda.synchronize()
    with Sources() as m: fn()
    torch.cuda.synchronize()
    return {"ops": sum(m.agg.values()), "by_source": m.agg.most_common(80)}

def llm_for(path, mode):
    llm = dspark.LLM(path, speculative=mode, device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=512,
                     kv_cache_memory_bytes=2**30, enable_prefix_caching=False)
    llm.generate([list(range(5, 133))], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return llm

medium = dspark.make_tiny_checkpoint(tempfile.mkdtemp(), preset="medium", seed=0, drafter=None)
for name, path, mode in (("default_none", DEFAULT_MODEL, None), ("default_dspark", DEFAULT_MODEL, "dspark"),
                         ("medium_none", medium, None)):
    llm = llm_for(path, mode); g = llm.graphs
    def step(n):
        def run(): g._pad_only(n); g.run(n)
        return run
    out = {"decode_1": sources(step(1))}
    if mode:
        pr, dg = llm.runner.proposer, llm.runner.proposer.graphs
        out["draft_1"] = sources(lambda: pr.draft_tensors(dg.slots[:1], dg.anchors[:1], dg.P[:1], dg.K))
    res[name] = out
    for k, v in out.items(): print(name, k, v["ops"], json.dumps(v["by_source"][:50], indent=0), flush=True)
    del llm, g; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/op_sources.json", "w"), indent=1)
