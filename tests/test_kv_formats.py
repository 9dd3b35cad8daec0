"""KV formats of the real checkpoints (`--kv-cache-dtype fp8`) and the opt-in FP8 draft head.

Tolerances:
- FP8 cache vs the same cached forward on an fp32 cache with the quantisation simulated (`simulate_qat`):
  bit-identical for every chunking (the same fp32 numbers are rounded the same way; storing is exact).
- FP8 cache vs the full reference forward with `simulate_qat`, fp32: a one-shot prefill is bit-identical.
  Chunked prefill and decode compute the pre-quantisation rows in a different order (fp32 differences ~4e-6,
  as in test_kv_cache); now and then one of those values sits on an FP8/FP4 rounding boundary and moves by one
  code step (2^-4 of itself for FP8, a whole grid step for FP4, which can swap an indexer top-k pick), and
  that propagates. Observed over 4 prompts: <= 1.6e-2 of max|logit| (6e-4 for the prompt below; ~130 of 390K
  stored bytes differ). Tolerance 5e-2 of max|logit|, still 4-5x below the effect of the quantisation itself
  (0.23 of max|logit|), so a path that skipped or misapplied it fails. Whether a boundary value moves depends on
  the CPU's GEMM kernels (AVX2 or AVX-512 MKL round the pre-quantisation rows differently): on one machine a
  swapped top-k pick put one of the prompt's 150 rows at 0.12 of max|logit|. So the check is on rows: at most
  two of them may exceed the tolerance (skipping the quantisation puts 15 of them past it).
- FP8 draft head vs the fp32 head: each weight moves by at most 2^-4 of itself (normal e4m3 values, round to
  nearest) or 2^-10 of its row scale (subnormals), so each logit moves by at most
  2^-4 * sum_j |x_j W_vj| + 2^-10 * s_v * sum_j |x_j|; checked exactly.
"""
import pytest
import torch

from dspark import LLM, SamplingParams, preset
from dspark.cache.kv_cache import (CacheConfig, PagedKVCache, SeqView, cache_format, forward_cached, kv_bytes_per_token,
                             plan_cache, profile_line, simulate_qat)

N = 150


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (N,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def qat_logits(tiny_model, ids):
    n = torch.get_num_threads(); torch.set_num_threads(1)             # the reduction order of the tests below
    simulate_qat(tiny_model)
    try: return tiny_model.logits(ids[None])[0]
    finally: simulate_qat(tiny_model, False); torch.set_num_threads(n)


def _run(model, ids, sizes, fp8=True):
    cache = PagedKVCache(model.cfg, CacheConfig(block_size=32, num_blocks=16, num_window_blocks=8, max_seqs=1, fp8=fp8))
    out, s = [], 0
    for n in sizes:
        out.append(forward_cached(model, cache, [ids[s:s + n]], [SeqView([3, 0, 7, 1, 5], [7, 6, 5, 4, 3, 2], 0, s)])[0])
        s += n
    return torch.cat(out)


def _layers(cfg, kind):
    return sum(cfg.layer_type(i) == kind for i in range(cfg.num_hidden_layers))


def test_bytes_per_token_match_reference_formula():
    "Reference §3.3: fp8_ds_mla row = nope FP8 + rope BF16 + 8 scale bytes; MXFP4 key = d_I/2 + d_I/32."
    m = preset("medium")
    csa, hca = _layers(m, "compressed_sparse_attention"), _layers(m, "heavily_compressed_attention")
    row = (512 - 64) + 64 * 2 + 8                                      # 584
    key = 128 // 2 + 128 // 32                                         # 68
    assert (row, key) == (584, 68)
    assert kv_bytes_per_token(m, fp8=True) == csa * (row + key) / 4 + hca * row / 128 == pytest.approx(837.8125)
    t = preset("tiny")                                                 # head_dim 128: 64 FP8 + 128 rope + 8 scales
    assert kv_bytes_per_token(t, fp8=True) == 2 * (200 + 68) / 4 + 2 * 200 / 16
    assert kv_bytes_per_token(t, fp8=True, include_window=True) == kv_bytes_per_token(t, fp8=True) + 6 * 200


@pytest.mark.parametrize("name", ["tiny", "medium"])
def test_fp8_fits_1_8x_the_bf16_tokens(name):
    cfg = preset(name)
    bs = 128 if name == "medium" else 64
    plan = lambda fp8: plan_cache(cfg, 8 * 2**30, bs, 16, 2048, 5, torch.bfloat16, fp8)
    bf16, fp8 = plan(False), plan(True)
    assert fp8.fp8 and fp8.num_blocks >= 1.8 * bf16.num_blocks, (fp8.num_blocks, bf16.num_blocks)
    if name == "medium":
        assert "838 B/token" in profile_line(cfg, fp8, 65536) and "fp8_ds_mla" in profile_line(cfg, fp8, 65536)
    # the cache really allocates what the plan charged for
    small = CacheConfig(block_size=bs, num_blocks=4, num_window_blocks=3, max_seqs=1, fp8=True)
    cache = PagedKVCache(cfg, small, device="meta")
    pools = list(cache.entries.values()) + list(cache.index_keys.values())
    assert sum(p.numel() for p in pools) == round(kv_bytes_per_token(cfg, fp8=True) * bs * (4 + 1))   # + scratch
    assert sum(w.numel() for w in cache.window) == (3 + 1) * bs * cfg.num_hidden_layers * (584 if name == "medium" else 200)


SPLITS = [[N], [131] + [1] * 19, [17] * 8 + [14]]                    # one-shot; prefill + decode steps; chunks


def test_fp8_cache_equals_reference_with_the_same_quantisation(tiny_model, ids, qat_logits):
    clean = tiny_model.logits(ids[None])[0]
    tol = 5e-2 * qat_logits.abs().max()
    assert (clean - qat_logits).abs().max() > 4 * tol                  # the quantisation is visible in the logits
    got = [_run(tiny_model, ids, sizes) for sizes in SPLITS]
    assert torch.equal(got[0], qat_logits)                             # one-shot prefill: bit-identical
    for g in got[1:]:
        off = (g - qat_logits).abs().amax(-1) > tol                   # rows moved by a swapped top-k pick
        assert off.sum() <= 2, off.nonzero().flatten().tolist()
    simulate_qat(tiny_model)                                           # the option on a plain fp32 cache
    try: sim = [_run(tiny_model, ids, sizes, fp8=False) for sizes in SPLITS]
    finally: simulate_qat(tiny_model, False)
    for g, s in zip(got, sim): assert torch.equal(g, s)                # storing FP8 == simulating it, any chunking


def test_fp8_rows_are_stored_compactly(tiny_model, ids):
    cfg = tiny_model.cfg
    cache = PagedKVCache(cfg, CacheConfig(block_size=32, num_blocks=6, num_window_blocks=6, max_seqs=1, fp8=True))
    forward_cached(tiny_model, cache, [ids[:64]], [SeqView([0, 1], [2, 3], 0, 0)])
    data, scales = cache.packed(cache.window[0])
    assert cache.window[0].dtype == torch.uint8 and data.shape == (7, 32, 64 + 128) and scales.shape == (7, 32, 8)   # 6 + scratch
    assert (scales[0, :, 0] > 0).all() and (scales[0, :, 1:] == 0).all()    # one UE8M0 scale, 7 pad bytes
    assert (scales[4:] == 0).all()                                            # untouched blocks
    kd, ks = cache.packed(cache.index_keys[2], index=True)
    assert kd.shape == (7, 8, 64) and ks.shape == (7, 8, 4)


def test_bad_kv_cache_dtype_is_named(tiny_ckpt):
    with pytest.raises(ValueError, match="'auto', 'bf16', 'fp8'.*'int4'"):
        cache_format("int4", torch.float32)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cache_format("fp8", torch.float16)
    assert cache_format("auto", torch.float32) == (torch.float32, False)
    assert cache_format("bf16", torch.float32) == (torch.bfloat16, False)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(tiny_ckpt, kv_cache_dtype="fp9", kv_cache_memory_bytes=8 * 2**20)
    with pytest.raises(ValueError, match="speculative='dspark'"):
        LLM(tiny_ckpt, fp8_draft_head=True, kv_cache_memory_bytes=8 * 2**20)


def test_llm_with_fp8_kv_follows_the_quantised_reference(tiny_ckpt, tiny_model):
    llm = LLM(tiny_ckpt, kv_cache_dtype="fp8", kv_cache_memory_bytes=8 * 2**20, max_num_seqs=2)
    assert llm.runner.cache.cc.fp8 and "fp8_ds_mla" in llm.profile
    prompt = list(range(3, 40))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    simulate_qat(tiny_model)
    try:
        ref, seq = [], list(prompt)
        for _ in range(6):
            ref.append(int(tiny_model.logits(torch.tensor([seq]))[0, -1].argmax())); seq.append(ref[-1])
    finally: simulate_qat(tiny_model, False)
    assert out == ref
    spec = LLM(tiny_ckpt, speculative="dspark", kv_cache_dtype="fp8", kv_cache_memory_bytes=8 * 2**20, max_num_seqs=2)
    assert spec.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids == out


def test_fp8_draft_head_bound_and_lossless(tiny_ckpt):
    prompts = [list(range(5, 30)), [7, 8, 9] * 9]
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    base = LLM(tiny_ckpt, kv_cache_memory_bytes=8 * 2**20, max_num_seqs=2)
    spec = LLM(tiny_ckpt, speculative="dspark", fp8_draft_head=True, kv_cache_memory_bytes=8 * 2**20, max_num_seqs=2)
    d = spec.runner.proposer.drafter
    W = d.target.head.weight
    assert d.fp8_head.weight.dtype == torch.float8_e4m3fn and d.fp8_head.nbytes() == W.numel() + 4 * W.shape[0]
    h = torch.randn(6, W.shape[1], generator=torch.Generator().manual_seed(0))
    x = d.last.norm(h)
    exact, fp8 = x @ W.T, d.base_logits(h)
    bound = 2**-4 * (x.abs() @ W.abs().T) + 2**-10 * d.fp8_head.scale * x.abs().sum(-1, keepdim=True) + 1e-5
    assert ((fp8 - exact).abs() <= bound).all() and not torch.equal(fp8, exact)
    a = [o.outputs[0].token_ids for o in base.generate(prompts, greedy, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy, use_tqdm=False)]
    assert a == b and spec.spec_stats()["num_drafts"] > 0


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="the FP8 GEMM path needs FP8 tensor cores")
def test_fp8_draft_head_scaled_mm_on_the_gpu():
    """On an FP8 GPU the head is `torch._scaled_mm` with e4m3 activations: within the bound of both roundings (weight
    and activation, 2⁻⁴ of each product's size each) plus the bf16 output's, and it really takes that path."""
    from dspark.model.drafter import RowwiseFP8Head
    g = torch.Generator().manual_seed(0)
    W = (torch.randn(4112, 256, generator=g) * 0.05).cuda().bfloat16()
    head = RowwiseFP8Head(W)
    assert head.scaled_mm
    for M in (1, 5, 37, 320):
        x = torch.randn(M, 256, generator=g).cuda().bfloat16()
        exact = x.float() @ W.float().T
        bound = 2**-3 * (x.abs().float() @ W.abs().float().T) + 2**-8 * exact.abs() + 1e-4
        got = head(x)
        assert got.shape == (M, 4112) and ((got - exact).abs() <= bound).all()


def test_serve_flags(tiny_ckpt):
    from dspark.entrypoints.serve import parse_args, resolve
    a = parse_args(["--model", str(tiny_ckpt), "--device", "cpu"], env={"DSPARK_KV_CACHE_DTYPE": "fp8"})
    assert a.kv_cache_dtype == "fp8" and a.fp8_draft_head is False
    conf, plan = resolve(a)
    assert conf["kv_cache_dtype"] == "fp8" and any("fp8_ds_mla" in line for line in plan)
    assert parse_args(["--fp8-draft-head", "--kv-cache-dtype", "bf16"], env={}).fp8_draft_head
    with pytest.raises(SystemExit):
        parse_args(["--kv-cache-dtype", "int8"], env={})
