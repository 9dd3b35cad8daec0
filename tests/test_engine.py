"""The offline LLM API end to end: parity with transformers, batching, preemption, prefix cache, seeds, stops."""
import pytest
import torch

import dspark
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)


def _prompts(n, seed=0, lo=5, hi=90):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers_generate(tiny_ckpt, llm):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompt = _prompts(1, seed=4, lo=30, hi=31)[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt):].tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref and out.outputs[0].finish_reason == "length"


def test_batch_of_8_equals_each_alone(llm):
    prompts = _prompts(8, seed=1)
    assert len({len(p) for p in prompts}) > 4
    together = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    for p, t in zip(prompts, together):
        assert _ids(llm.generate([p], GREEDY, use_tqdm=False))[0] == t


def test_preemption_keeps_outputs_identical(tiny_ckpt, llm):
    prompts = _prompts(6, seed=2, lo=30, hi=60)
    sp = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = _ids(llm.generate(prompts, sp, use_tqdm=False))
    small = LLM(tiny_ckpt, max_num_seqs=6, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20,
                num_kv_blocks=5, enable_prefix_caching=False)
    got = _ids(small.generate(prompts, sp, use_tqdm=False))
    assert small.scheduler.num_preemptions > 0
    assert got == ref
    kv = small.scheduler.kv
    assert kv.comp.num_free == 5 and kv.window.num_free == len(kv.window.ref) and len(kv.slots) == 6


def test_seeded_sampling_independent_of_batch(llm):
    prompts = _prompts(5, seed=3)
    sps = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=15, seed=100 + i, ignore_eos=True) for i in range(5)]
    together = _ids(llm.generate(prompts, sps, use_tqdm=False))
    reordered = _ids(llm.generate(prompts[::-1], sps[::-1], use_tqdm=False))[::-1]
    alone = [_ids(llm.generate([p], s, use_tqdm=False))[0] for p, s in zip(prompts[:2], sps[:2])]
    assert together == reordered and together[:2] == alone
    assert len({tuple(t) for t in together}) == 5


def test_prefix_cache_hits_and_identical_output(tiny_ckpt):
    eng = LLM(tiny_ckpt, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
    shared = _prompts(1, seed=5, lo=140, hi=141)[0]
    prompts = [shared + p for p in _prompts(3, seed=6, lo=3, hi=20)]
    cold = _ids(eng.generate(prompts, GREEDY, use_tqdm=False))
    before = eng.prefix_cache_stats()["hits"]
    warm = eng.generate(prompts, GREEDY, use_tqdm=False)
    assert eng.prefix_cache_stats()["hits"] > before
    assert all(o.num_cached_tokens > 0 for o in warm)
    assert _ids(warm) == cold
    off = LLM(tiny_ckpt, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20,
              enable_prefix_caching=False)
    assert _ids(off.generate(prompts, GREEDY, use_tqdm=False)) == cold


def test_chunked_prefill_through_the_engine(tiny_ckpt, llm):
    prompts = _prompts(3, seed=7, lo=100, hi=200)
    ref = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    tiny_budget = LLM(tiny_ckpt, max_num_seqs=3, max_num_batched_tokens=17, kv_cache_memory_bytes=32 * 2**20)
    assert _ids(tiny_budget.generate(prompts, GREEDY, use_tqdm=False)) == ref


def test_mixed_steps_are_trimmed_to_the_captured_size(tiny_ckpt, llm):
    """While requests decode, short prompts' prefill is cut so the step fits the largest captured step (set here
    by hand: the CPU captures none); a long prompt and a step without decoders are not cut; outputs are unchanged."""
    eng = LLM(tiny_ckpt, max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
    eng.scheduler.sc.mixed_step_tokens = 16
    s, sizes = eng.scheduler, []
    for p in _prompts(3, seed=3, lo=30, hi=40): eng.add_request(p, GREEDY)
    sizes.append(sum(n for _, n in s.schedule()))                # no decoders yet: the three prompts whole
    assert sizes[0] > 16
    for r in s.running: r.num_computed = r.num_tokens - 1        # as after their prefill: three decoders
    eng.add_request(list(range(5, 20)), GREEDY)                  # 15 tokens: 3 + 15 > 16, so 13 now
    assert [n for _, n in s.schedule()] == [1, 1, 1, 13]
    assert s.prefill_room(True) == 13
    eng.add_request(list(range(5, 45)), GREEDY)                  # a 40-token prompt is long: not cut
    assert s.prefill_room(True) == 256
    s.waiting.pop()
    for _ in range(2): eng.add_request(list(range(5, 15)), GREEDY)   # short ones at once: cut, in turn
    assert s.prefill_room(True) == 13 and s.prefill_room(False) == 13   # 15 + 20 + 3 > 16; the 15 still runs
    prompts = _prompts(6, seed=11, lo=5, hi=30)
    ref = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    eng2 = LLM(tiny_ckpt, max_num_seqs=3, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
    eng2.scheduler.sc.mixed_step_tokens = 16
    assert _ids(eng2.generate(prompts, GREEDY, use_tqdm=False)) == ref


def test_stops_and_finish_reasons(llm):
    p = _prompts(1, seed=8)[0]
    free = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    stop_tok = free.token_ids[5]
    o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok], ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == stop_tok and len(o.token_ids) == free.token_ids.index(stop_tok) + 1
    if len(free.text) > 6:
        s = free.text[3:6]
        o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=30, stop=s, ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert o.finish_reason == "stop" and s not in o.text and free.text.startswith(o.text)
    o = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == 4 and all(o.token_ids[i] in o.logprobs[i] for i in range(4))
    assert all(max(d.values()) <= 0 for d in o.logprobs)


def test_text_prompts_and_detokenised_output(llm):
    outs = llm.generate(["Beautiful is better than", "Flat is better"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for o in outs:
        assert o.prompt_token_ids[0] == llm.tokenizer.bos_token_id
        assert o.outputs[0].text == llm.tokenizer.decode(o.outputs[0].token_ids)


def test_text_decoded_at_the_end_equals_the_streamed_text(llm):
    """`generate` decodes a request's ids once, when it finishes (no stop strings): the same text as a request
    detokenised step by step, whose deltas add up to it; a lazy request's deltas carry all the text at the end."""
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    lazy = llm.generate(["Beautiful is better than"], sp, use_tqdm=False)[0].outputs[0]
    streamed, texts = llm.add_request("Beautiful is better than", sp), {}
    quiet = llm.add_request("Beautiful is better than", sp, stream_text=False)
    while llm.has_unfinished_requests():
        for d in llm.step(): texts.setdefault(d.request_id, []).append(d.text)
    assert lazy.text == "".join(texts[streamed]) == "".join(texts[quiet]) == llm.tokenizer.decode(lazy.token_ids)
    assert len(texts[streamed]) > 2 and all(t == "" for t in texts[quiet][:-1]) and texts[quiet][-1] == lazy.text
    for rid in (streamed, quiet): assert llm.pop_output(rid).outputs[0].text == lazy.text


@pytest.mark.parametrize("prompt,kwargs,match", [
    ([1] * 2000, {}, "max_model_len"),
    ("", {}, "empty"),
    ([], {}, "empty"),
    ([1, 2, 600], {}, "vocabulary"),
    ([1, 2], {"temperature": -1}, "temperature"),
    ([1, 2], {"top_p": 0}, "top_p"),
    ([1, 2], {"top_k": 0}, "top_k"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"stop": [5]}, "stop"),
])
def test_bad_input_is_refused_before_any_work(llm, prompt, kwargs, match):
    before = llm._count
    with pytest.raises((ValueError, TypeError), match=match):
        llm.generate([[3, 4, 5], prompt], SamplingParams(**kwargs) if kwargs else None, use_tqdm=False)
    assert not llm.scheduler.has_work() and llm._count == before


def test_profile_line_medium_matches_formula():
    from dspark.cache.kv_cache import plan_cache, profile_line
    med = dspark.preset("medium")
    line = profile_line(med, plan_cache(med, 2**30, 128, 16, 2048, 0, torch.bfloat16), 65536)
    assert "1640 B/token" in line and "KV tokens" in line and "max concurrency" in line


def test_unsupported_modes_are_refused(tiny_ckpt):
    with pytest.raises(ValueError, match="speculative"):
        LLM(tiny_ckpt, speculative="eagle")
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide num_attention_heads=8"):
        LLM(tiny_ckpt, tensor_parallel_size=3)          # refused before any worker starts


def test_chat_uses_the_template(llm):
    msgs = [{"role": "user", "content": "Simple is better"}]
    out = llm.chat(msgs, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(msgs)
    assert out.prompt_token_ids.count(llm.tokenizer.bos_token_id) == 1


def test_abort_frees_blocks(tiny_ckpt):
    from dspark.request import Request
    from dspark.runtime.runner import RunnerOutput
    eng = LLM(tiny_ckpt, max_num_seqs=2, kv_cache_memory_bytes=16 * 2**20)
    s, kv = eng.scheduler, eng.scheduler.kv
    free0 = kv.comp.num_free
    s.add(Request("a", list(range(2, 90)), SamplingParams(), seed=1))
    s.update(s.schedule(), RunnerOutput())
    assert kv.comp.num_free < free0
    assert s.abort("a").finish_reason == "abort" and kv.comp.num_free == free0 and not s.has_work()
    assert s.abort("missing") is None


def test_a_step_may_hold_more_tokens_than_one_sequence_may(tmp_path):
    """A step concatenates many requests' tokens; only each request's positions are bounded by
    max_position_embeddings (1024 in `tiny`), not the step's total (here 3 × 400 tokens in one step)."""
    ck = dspark.make_tiny_checkpoint(tmp_path / "ck", seed=0, drafter=None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 512, (400,), generator=g).tolist() for _ in range(3)]
    llm = dspark.LLM(ck, max_num_seqs=3, max_num_batched_tokens=2048, kv_cache_memory_bytes=64 * 2**20)
    outs = llm.generate(prompts, dspark.SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2, 2]


def test_request_span_is_a_slice_of_the_whole_sequence():
    "`Request.span(a, b)` equals `(prompt + output + drafts)[a:b]` for every range, without building the sequence."
    from dspark.request import Request
    r = Request("r", [1, 2, 3, 4], SamplingParams(), 0, output_ids=[5, 6], drafts=[7, 8, 9])
    whole = r.prompt_ids + r.output_ids + r.drafts
    for a in range(len(whole) + 1):
        for b in range(a, len(whole) + 2):
            assert r.span(a, b) == whole[a:b], (a, b)
    assert Request("s", [1], SamplingParams(), 0) != Request("s", [1], SamplingParams(), 0)   # requests are identities


def test_llm_without_a_model_loads_the_embedded_default():
    "`dspark.LLM()` serves the embedded model, as `python -m dspark.serve` does with no `--model`."
    from dspark.model.checkpoint import DEFAULT_MODEL
    llm = dspark.LLM(max_num_seqs=1, kv_cache_memory_bytes=16 * 2**20)
    assert llm.model_path == DEFAULT_MODEL and llm.engine.model_path == DEFAULT_MODEL
    out = llm.generate(["def main("], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.prompt_token_ids == llm.tokenizer.encode("def main(")


@pytest.mark.parametrize("temperature,cap", [(0.0, None), (1.0, None), (0.0, 6)])
def test_prompt_logprobs_over_chunked_prefill_equal_the_full_forward(tiny_ckpt, tiny_model, temperature, cap, monkeypatch):
    """`SamplingParams.prompt_logprobs`: a prompt prefilled in 16-token chunks, with DSpark drafting, hands back on its
    first delta every prompt token's logprob, rank and top-k, equal to one full forward's (the first token: None).
    With `cap`, `PROMPT_LOGPROB_ROWS` (the memory plan's rows for such a chunk) is smaller than the step's budget:
    its chunks stay within it while a plain prompt beside it takes the rest of the budget."""
    import dspark.engine.scheduler as S
    if cap: monkeypatch.setattr(S, "PROMPT_LOGPROB_ROWS", cap)
    llm = LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=3, max_model_len=256,
              kv_cache_memory_bytes=32 * 2**20, max_num_seqs=4, max_num_batched_tokens=16)
    ids = [5 + (7 * i) % 400 for i in range(70)]
    rid = llm.add_request(ids, SamplingParams(temperature=temperature, max_tokens=4, prompt_logprobs=3, seed=1))
    other = llm.add_request(ids[:40], SamplingParams(temperature=0.0, max_tokens=2)) if cap else None
    sched, chunks = llm.engine.scheduler, []                 # (request, prompt tokens it runs) of each scheduled chunk
    schedule = sched.schedule
    def watched(*a, **k):
        out = schedule(*a, **k)
        chunks.extend((r.request_id, n) for r, n in out if r.num_tokens - r.num_computed > 1)
        return out
    sched.schedule = watched
    deltas = []
    while llm.has_unfinished_requests(): deltas += [d for d in llm.step() if d.request_id == rid]
    if cap:
        assert max(n for i, n in chunks if i == rid) == cap and max(n for i, n in chunks if i == other) > cap
        llm.pop_output(other)
    assert deltas[0].prompt_logprobs is not None and all(d.prompt_logprobs is None for d in deltas[1:])
    plp, ref = deltas[0].prompt_logprobs, tiny_model.logits(torch.tensor([ids]))[0].log_softmax(-1)
    assert len(plp) == len(ids) and plp[0] is None
    for j in range(1, len(ids)):
        rank, d = plp[j]
        assert next(iter(d)) == ids[j] and d[ids[j]] == pytest.approx(ref[j - 1, ids[j]].item(), abs=1e-4)
        assert rank == int((ref[j - 1] > ref[j - 1, ids[j]]).sum()) + 1
        assert set(ref[j - 1].topk(3).indices.tolist()) <= set(d)
    llm.pop_output(rid)
