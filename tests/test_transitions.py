"""Load transitions, eviction and streamed text on CPU (issue 42): prefill chunks hold exactly their blocks while
decoding requests keep the lookahead; a cold C1 → C64 → C1 sequence gives each phase a fresh engine's tokens; a
cache too small for every running request preempts and recomputes, with prefix-cache hits before and after, and
gives the unconstrained tokens; streamed text never shows U+FFFD and equals the one-shot decode."""
import asyncio

import pytest

import dspark
from dspark.cache.kv_cache import CacheConfig
from dspark.config import preset
from dspark.engine.async_engine import AsyncEngine
from dspark.engine.scheduler import KVCacheManager, Scheduler, SchedulerConfig
from dspark.model.checkpoint import DEFAULT_MODEL
from dspark.request import Request
from dspark.runtime.runner import RunnerOutput
from dspark.sample.sampling import SamplingParams


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_prefill_chunks_hold_exactly_their_blocks_and_decoders_keep_the_lookahead():
    "16-token blocks, lookahead 6: one step carries a decoding request and a 64-token prompt's chunks."
    kv = KVCacheManager(preset("tiny"), CacheConfig(block_size=16, num_blocks=20, num_window_blocks=40, max_seqs=4))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=41, max_model_len=256, lookahead=6), kv)
    a = Request("a", list(range(1, 31)), SamplingParams(), seed=0); sched.add(a)
    step = sched.schedule()
    assert step == [(a, 30)] and len(a.table) == 2                     # a prompt: ceil(30/16), not ceil(36/16)
    sched.update(step, RunnerOutput(tokens={"a": [7]}))
    b = Request("b", list(range(100, 164)), SamplingParams(), seed=1); sched.add(b)
    step = sched.schedule()                                           # a decodes position 30, b's first chunk: 40
    assert step == [(a, 1), (b, 40)]
    assert (len(a.table), len(b.table)) == (3, 3)                     # ceil((31 + 6)/16); ceil(40/16)
    sched.update(step, RunnerOutput(tokens={"a": [7]}))
    step = sched.schedule()
    assert step == [(a, 1), (b, 24)]
    assert (len(a.table), len(b.table), len(b.window_table)) == (3, 4, 4)   # b's last chunk: ceil(64/16), not 5
    sched.update(step, RunnerOutput(tokens={"a": [7], "b": [9]}))
    step = sched.schedule()
    assert step == [(a, 1), (b, 1)] and len(b.table) == 5              # b decodes now: ceil((65 + 6)/16)
    assert kv.comp.num_free == 20 - 3 - 5


def _phase(llm, prompts, sp):
    return _ids(llm.generate(prompts, sp, use_tqdm=False))


def test_cold_c1_c64_c1_gives_a_fresh_engines_tokens():
    """One engine runs 1, then 64, then 1 concurrent requests (the last one's prompt is the first one's: a prefix
    hit); each phase's tokens equal those of a fresh engine that runs only that phase."""
    kw = dict(speculative="dspark", num_speculative_tokens=3, max_num_seqs=64, max_model_len=256,
              kv_cache_memory_bytes=96 * 2**20)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = [list(range(300, 500))]                                     # three 64-token blocks: a hit resumes at 64
    many = [[(7 * i + j) % 4000 + 10 for j in range(8 + i % 5)] for i in range(64)]
    phases = [one, many, one]
    llm = dspark.LLM(DEFAULT_MODEL, **kw)
    got = [_phase(llm, p, sp) for p in phases]
    assert llm.scheduler.kv.hits > 0                                  # the last phase re-entered the first's prefix
    assert llm.spec_stats()["num_drafts"] > 0
    fresh = [_phase(dspark.LLM(DEFAULT_MODEL, **kw), p, sp) for p in phases[:2]]
    assert got[0] == fresh[0] and got[1] == fresh[1] and got[2] == fresh[0]


def test_eviction_and_recompute_give_the_unconstrained_tokens():
    """Six requests on a shared 192-token prefix, 70 tokens each, in a cache of 12 blocks of 64 (they need 15):
    requests are preempted and recomputed. The prefix cached by a first request is hit before the squeeze, and
    again by a request after it; every token equals that of the same sequence on an unconstrained cache."""
    prefix = [(11 * j) % 3000 + 50 for j in range(192)]
    first = [prefix + [1000 + j for j in range(10)]]
    squeeze = [prefix + [2000 + 13 * i + j for j in range(5 + i)] for i in range(6)]
    after = [prefix + [3000 + j for j in range(7)]]
    sp = SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True)

    def run(**kv):
        llm = dspark.LLM(DEFAULT_MODEL, max_num_seqs=8, max_model_len=512, **kv)
        outs = [llm.generate(p, sp, use_tqdm=False) for p in (first, squeeze, after)]
        return llm, [_ids(o) for o in outs], [[o.num_cached_tokens for o in out] for out in outs]

    small, got, cached = run(kv_cache_memory_bytes=32 * 2**20, num_kv_blocks=12)
    assert small.scheduler.num_preemptions > 0                        # the cache really was too small
    assert cached[0] == [0] and min(cached[1]) >= 128 and cached[2][0] >= 128   # prefix hits before and after
    big, want, _ = run(kv_cache_memory_bytes=32 * 2**20)
    assert big.scheduler.num_preemptions == 0 and got == want


@pytest.fixture(scope="module")
def streamer():
    llm = dspark.LLM(DEFAULT_MODEL, max_num_seqs=4, max_model_len=1100, kv_cache_memory_bytes=32 * 2**20)
    eng = AsyncEngine(llm).start()
    yield llm, eng
    eng.shutdown()


def _stream(eng, prompt, n):
    async def go():
        return [d async for d in eng.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))]
    return asyncio.run(go())


@pytest.mark.parametrize("prompt,n", [("def quicksort(xs):\n    ", 512), ("请用中文解释：快速排序 🚀🙂 是什么？", 96)])
def test_streamed_text_has_no_replacement_char_and_equals_the_one_shot_decode(streamer, prompt, n):
    llm, eng = streamer
    deltas = _stream(eng, prompt, n)
    ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert len(ids) == n and deltas[-1].finish_reason == "length"
    assert "\ufffd" not in text and text == llm.tokenizer.decode(ids)
    if prompt.startswith("请"):                 # byte tokens: some steps end inside a character and hold it back
        assert any("\ufffd" in llm.tokenizer.decode(d.token_ids) for d in deltas)
