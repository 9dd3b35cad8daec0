"""Peak working memory of an eager prefill step (runtime.memory.step_peak_bytes, the engine's own measurement) with the
mHC buffer switches of dspark.model.mhc off and on: V4-Flash width (hidden 4096, hc 4, vocab 129280, its first four
layer kinds) cut to 4 layers and 16 bf16 routed experts, fused mHC and Triton attention (forward_batched), taps on
layers 1 and 3 (the last). Also checks each setting's logits and features against all-off. OUT=. python mhc_buffers_gpu.py"""
import dataclasses, functools, json, os, time
import torch
from dspark.config import load_config, named_configs
from dspark.model import mhc
from dspark.model.transformer import Transformer
from dspark.tools.train_model import init_weights
from dspark.runtime.graphs import fast_path
from dspark.runtime.memory import step_peak_bytes
from dspark.kernels.fused import forward_batched
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView

OUT = os.environ.get("OUT", ".")
flash = load_config(named_configs()["deepseek-v4-flash"])
cfg = dataclasses.replace(flash, num_hidden_layers=4, compress_ratios=flash.compress_ratios[:4], num_hash_layers=0,
                          n_routed_experts=16, expert_dtype=None, quantization_config=None, dspark_target_layer_ids=None)
t0 = time.time()
model = init_weights(Transformer(cfg), seed=0, layers=4).to("cuda", torch.bfloat16).eval()
print(f"model built in {time.time() - t0:.0f}s", flush=True)
fused = fast_path(model)
fwd = functools.partial(forward_batched, mhc=fused)
taps = (1, 3)
SETTINGS = {"off": (False, False, False), "inplace_post": (False, True, False), "pingpong": (False, False, True),
            "fuse_final": (True, False, False), "all_on": (True, True, True)}
def set_flags(v): mhc.FUSE_FINAL, mhc.INPLACE_POST, mhc.PINGPONG = v
def outputs(T):
    cache = PagedKVCache(cfg, CacheConfig(256, T // 256 + 2, T // 256 + 2, 1, 0, torch.bfloat16), "cuda")
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(T)).cuda()
    tab = list(range(T // 256 + 2)); feats = []
    logits = fwd(model, cache, [ids], [SeqView(tab, tab, 0, 0)], taps, feats)[0]
    return logits, feats[0]
res = {"gpu": torch.cuda.get_device_name(), "rows": []}
for T in (2048, 8192):
    set_flags(SETTINGS["off"]); want = outputs(T)
    for name, v in SETTINGS.items():
        set_flags(v)
        got = outputs(T)
        err = [(a.float() - b.float()).abs().max().item() for a, b in zip(got, want)]
        del got
        peaks = [step_peak_bytes(model, fwd, T, T, 256, torch.bfloat16, taps) for _ in range(2)]
        row = {"T": T, "setting": name, "peak_MiB": round(min(peaks) / 2**20, 1), "logit_err": err[0], "feat_err": err[1],
               "stream_buffer_MiB": T * cfg.hc_mult * cfg.hidden_size * 2 / 2**20}
        print(json.dumps(row), flush=True); res["rows"].append(row)
    del want; torch.cuda.empty_cache()
json.dump(res, open(f"{OUT}/mhc_buffers.json", "w"), indent=1)
