"""Batch-invariant reference mode (`dspark.batch_invariant()`): a token's logits and cache rows are bitwise the
same whatever else shares its forward — other requests, the rest of a verify chunk — and the switch restores
the previous state on exit."""
import copy

import pytest
import torch

import dspark
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, forward_cached
from dspark.model.layers import is_batch_invariant

TAPS = (1, 3)


def _cache(cfg, seqs=1):
    return PagedKVCache(cfg, CacheConfig(block_size=32, num_blocks=4 * seqs, num_window_blocks=4 * seqs, max_seqs=seqs,
                                         lookahead=8))


def _view(i, start):
    "Request i owns blocks 4i..4i+3 of both groups and ring slot i."
    return SeqView(list(range(4 * i, 4 * i + 4)), list(range(4 * i, 4 * i + 4)), i, start)


def _forward(model, cache, chunks, starts):
    feats, finals = [], []
    logits = forward_cached(model, cache, chunks, [_view(i, s) for i, s in enumerate(starts)], taps=TAPS,
                            features=feats, finals=finals)
    return logits, feats, finals


def _ids(n, seed):
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def test_request_alone_equals_request_in_a_batch(tiny_model):
    "Logits, drafter features and final streams of a request do not change when other requests share the forward."
    chunks = [_ids(21, 1), _ids(34, 2), _ids(9, 3)]
    with dspark.batch_invariant():
        together = _forward(tiny_model, _cache(tiny_model.cfg, 3), chunks, [0, 0, 0])
        for i, c in enumerate(chunks):
            alone = _forward(tiny_model, _cache(tiny_model.cfg), [c], [0])
            for got, want in zip(alone, together):                    # logits, features, finals
                assert torch.equal(got[0], want[i]), i


def test_verify_chunk_equals_decode_steps(tiny_model):
    """A verify chunk of K + 1 = 6 tokens gives bitwise the logits of feeding the same tokens one decode step at
    a time, and leaves the same cache. Positions 74..79 complete compressed windows of both ratios (4 and 16),
    and the indexer picks its top 16 of 18..20 entries, so the compressors and the indexer see different
    numbers of entries in the two runs."""
    ids, P = _ids(80, 4), 74
    with dspark.batch_invariant():
        c1 = _cache(tiny_model.cfg)
        _forward(tiny_model, c1, [ids[:P]], [0])
        c2 = copy.deepcopy(c1)
        verify = _forward(tiny_model, c1, [ids[P:]], [P])
        steps = [_forward(tiny_model, c2, [ids[p:p + 1]], [p]) for p in range(P, 80)]
    for k in range(3):                                               # logits, features, finals
        assert torch.equal(verify[k][0], torch.cat([s[k][0] for s in steps]))
    for pools in ("window", "entries", "index_keys"):
        a, b = getattr(c1, pools), getattr(c2, pools)
        for l in (range(len(a)) if isinstance(a, list) else a):
            assert torch.equal(a[l], b[l]), (pools, l)


def test_cached_prefill_equals_full_forward(tiny_model):
    """In invariant mode the paged path and the plain full causal forward (`model.logits`) agree bit for bit, and
    both compute the default mode's function (same indexer choices, same experts), up to rounding."""
    ids = _ids(70, 5)                 # up to 17 entries of ratio 4: the indexer's top-16 really chooses
    with dspark.batch_invariant():
        full = tiny_model.logits(ids[None])[0]
        cached = _forward(tiny_model, _cache(tiny_model.cfg), [ids], [0])[0][0]
    assert torch.equal(full, cached)
    torch.testing.assert_close(full, tiny_model.logits(ids[None])[0], rtol=0, atol=1e-4)


def test_default_mode_batched_within_tolerance(tiny_model):
    "Without the mode a request's logits may drift in the last bits when batched (GEMM blocking, SIMD tails), no more."
    chunks = [_ids(21, 1), _ids(34, 2), _ids(9, 3)]
    together = _forward(tiny_model, _cache(tiny_model.cfg, 3), chunks, [0, 0, 0])[0][0]
    alone = _forward(tiny_model, _cache(tiny_model.cfg, 3), chunks[:1], [0])[0][0]
    torch.testing.assert_close(alone, together, rtol=0, atol=1e-4)


def test_switch_restores_state():
    assert not is_batch_invariant()
    with dspark.batch_invariant():
        assert is_batch_invariant()
        with dspark.batch_invariant(False):
            assert not is_batch_invariant()
        assert is_batch_invariant()
    assert not is_batch_invariant()
    with pytest.raises(RuntimeError, match="boom"):
        with dspark.batch_invariant():
            raise RuntimeError("boom")
    assert not is_batch_invariant()

    @dspark.batch_invariant()
    def inside():
        return is_batch_invariant()
    assert inside() and inside() and not is_batch_invariant()


def test_per_token_rejects_mismatched_token_dims():
    from dspark.model.layers import per_token
    with pytest.raises(ValueError, match="leading token dims"):
        per_token(torch.add, torch.zeros(2, 3), torch.zeros(3, 3))


def test_llm_batch_invariant_logprobs_do_not_depend_on_the_batch(tiny_ckpt):
    """`LLM(batch_invariant=True)`: a request's sampled tokens and their logprobs are bitwise the same served
    alone or beside other requests (which change every step's row counts)."""
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (9, 23, 5)]
    sp = dspark.SamplingParams(temperature=1.0, seed=11, max_tokens=5, logprobs=2, ignore_eos=True)
    llm = dspark.LLM(tiny_ckpt, batch_invariant=True, max_num_seqs=4, kv_cache_memory_bytes=16 * 2**20)
    alone = llm.generate(prompts[:1], sp, use_tqdm=False)[0].outputs[0]
    together = llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0]
    assert alone.token_ids == together.token_ids and alone.logprobs == together.logprobs
    with pytest.raises(ValueError, match="batch_invariant"):
        dspark.LLM(tiny_ckpt, batch_invariant=True, attention_backend="triton", kv_cache_memory_bytes=16 * 2**20)
