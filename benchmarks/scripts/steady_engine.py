"""The engine and prompts the steady-load records share (capacity_ab.py, capacity_host_profile.py): the one DSpark
engine `capacity_sweep` builds, with capacity control attached, for `C` requests in flight and `WAVES x C` held-out
128-token prompts, warmed up with its largest batch so no shape compiles in a timed run. Settings from the
environment: C (64), WAVES (4), REPEATS (the script's default), TOKENS (128)."""
import os
from dspark.tools.capacity_sweep import sweep_prompts
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams

def steady_engine(repeats: int):
    "`(C, WAVES, REPEATS, TOKENS, prompts, llm)`, the engine warmed up."
    C, WAVES, REPEATS, TOKENS = (int(os.environ.get(k, d)) for k, d in (("C", 64), ("WAVES", 4), ("REPEATS", repeats), ("TOKENS", 128)))
    prompts = sweep_prompts(DEFAULT_MODEL, C * WAVES, 128)
    llm = LLM(DEFAULT_MODEL, speculative="dspark", num_speculative_tokens=5, capacity="auto", device="cuda",
              dtype="bfloat16", seed=0, max_num_seqs=C, max_num_batched_tokens=max(1024, C * 134),
              max_model_len=128 + TOKENS + 7, enable_prefix_caching=False, kv_cache_memory_bytes=2 * 2**30)
    llm.generate(prompts[:C], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)   # compiles every shape
    return C, WAVES, REPEATS, TOKENS, prompts, llm
