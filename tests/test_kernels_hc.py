"""Fused mHC kernels (nbs/14_kernels_hc) against the reference `layers.hc_pre`, `hc_post` and `hc_head`.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before anything
imports triton), at small shapes; on a GPU machine they run compiled.
"""
import os

import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import copy
import dataclasses
from collections import Counter

import pytest

pytest.importorskip("triton")

from dspark.model import layers
from dspark.config import preset
from dspark.kernels.hc import (SPLIT_MIX_ROWS, aten_launches, hc_head_fused, hc_post_fused, hc_post_head_fused,
                               hc_pre_fused)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = preset("tiny")
HC = CFG.hc_mult


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _params(g, D, head=False, comb_scale=1.0):
    "Random mHC parameters with O(1) mixes, so the sigmoids and Sinkhorn are far from trivial."
    rows = HC if head else (2 + HC) * HC
    fn = torch.randn(rows, HC * D, generator=g) / (HC * D) ** 0.5
    base, scale = 0.5 * torch.randn(rows, generator=g), torch.rand(1 if head else 3, generator=g) + 0.5
    if not head: scale[2] = comb_scale
    return fn.to(DEV), base.to(DEV), scale.to(DEV)


@pytest.mark.parametrize("split,block_k", [(True, 256), (True, 64), (False, 256)])
@pytest.mark.parametrize("D,dtype,lead,block_d", [(64, torch.float32, (5,), None), (100, torch.float32, (2, 3), 32),
                                                  (64, torch.bfloat16, (1, 5), None), (100, torch.bfloat16, (2, 3), 32)])
def test_fused_matches_reference(D, dtype, lead, block_d, split, block_k):
    # split: the mixes from the split kernel (D = 100: hc·D = 400 is no multiple of block_k, so the last slice is
    # partial); False: from one GEMM, the path of steps with more than SPLIT_MIX_ROWS tokens
    g = torch.Generator().manual_seed(D)
    # fp32 math on both sides; bf16 outputs may differ by one rounding (the interpreter truncates, torch rounds)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    fn, base, scale = _params(g, D)
    x = torch.randn(*lead, HC, D, generator=g).to(DEV, dtype)
    out = torch.randn(*lead, D, generator=g).to(DEV, dtype)
    kw = dict(block_d=block_d, split=split, block_k=block_k)
    got, want = hc_pre_fused(x, fn, base, scale, CFG, **kw), layers.hc_pre(x, fn, base, scale, CFG)
    got += (hc_post_fused(out, x, got[1], got[2], block_d=block_d),)
    want += (layers.hc_post(out, x, want[1], want[2]),)
    hf, hb, hs = _params(g, D, head=True)
    got += (hc_head_fused(x, hf, hb, hs, CFG, **kw),)
    want += (layers.hc_head(x, hf, hb, hs, CFG),)
    for name, a, b in zip(("y", "post", "comb", "new x", "head"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5 if name in ("post", "comb") else rtol, atol=1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("iters", [20, 2, 1])
def test_sinkhorn_runs_every_iteration(iters):
    # peaked logits (comb scale 8): even the 20th iteration still moves comb by ~1e-3
    g = torch.Generator().manual_seed(1)
    fn, base, scale = _params(g, 64, comb_scale=8.0)
    x = torch.randn(5, HC, 64, generator=g).to(DEV)
    cfg = dataclasses.replace(CFG, hc_sinkhorn_iters=iters)
    comb = hc_pre_fused(x, fn, base, scale, cfg)[2]
    torch.testing.assert_close(comb, layers.hc_pre(x, fn, base, scale, cfg)[2], rtol=1e-5, atol=1e-6)
    if iters > 1:
        fewer = layers.hc_pre(x, fn, base, scale, dataclasses.replace(CFG, hc_sinkhorn_iters=iters - 1))[2]
        assert (comb - fewer).abs().max() > 1e-4


def test_launch_counts():
    g = torch.Generator().manual_seed(2)
    fn, base, scale = _params(g, 64)
    x = torch.randn(1, 1, HC, 64, generator=g).to(DEV, torch.bfloat16)
    out = torch.randn(1, 1, 64, generator=g).to(DEV, torch.bfloat16)
    _, post, comb = hc_pre_fused(x, fn, base, scale, CFG)
    assert sum(aten_launches(layers.hc_pre, x, fn, base, scale, CFG).values()) > 100
    assert aten_launches(hc_pre_fused, x, fn, base, scale, CFG) == Counter(
        {"triton:_hc_mix_kernel": 1, "triton:_hc_collapse_kernel": 1})          # a decode's few rows: two launches
    many = torch.randn(SPLIT_MIX_ROWS + 1, HC, 64, generator=g).to(DEV, torch.bfloat16)
    assert aten_launches(hc_pre_fused, many, fn, base, scale, CFG) == Counter(
        {"_to_copy": 1, "mm": 1, "triton:_hc_collapse_kernel": 1})              # a prefill's: one GEMM for all rows
    assert aten_launches(hc_pre_fused, many, fn, base, scale, CFG, split=True) == Counter(
        {"triton:_hc_mix_kernel": 1, "triton:_hc_collapse_kernel": 1})
    assert aten_launches(hc_post_fused, out, x, post, comb) == Counter({"triton:_hc_post_kernel": 1})


def test_edges_and_errors():
    g = torch.Generator().manual_seed(3)
    fn, base, scale = _params(g, 64)
    x = torch.randn(5, HC, 64, generator=g).to(DEV)
    y0, p0, c0 = hc_pre_fused(x[:0], fn, base, scale, CFG)
    assert y0.shape == (0, 64) and p0.shape == (0, HC) and c0.shape == (0, HC, HC)
    assert hc_post_fused(y0, x[:0], p0, c0).shape == (0, HC, 64)
    xt = torch.randn(HC, 5, 64, generator=g).to(DEV).transpose(0, 1)     # non-contiguous streams
    torch.testing.assert_close(hc_pre_fused(xt, fn, base, scale, CFG)[0], layers.hc_pre(xt, fn, base, scale, CFG)[0],
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="hc=4"): hc_pre_fused(x[:, :3], fn, base, scale, CFG)
    with pytest.raises(ValueError, match="fn must have shape"): hc_pre_fused(x, fn[:, :100], base, scale, CFG)
    with pytest.raises(ValueError, match="base must have shape"): hc_head_fused(x, fn[:HC], base, scale[:1], CFG)
    with pytest.raises(ValueError, match="comb must have shape"): hc_post_fused(y0[:5].new_zeros(5, 64), x, p0.new_zeros(5, HC), c0)
    with pytest.raises(ValueError, match="power of two"): hc_post_fused(y0, x[:0], p0, c0, block_d=48)
    with pytest.raises(ValueError, match="power of two"): hc_pre_fused(x, fn, base, scale, CFG, block_k=100)
    with layers.batch_invariant():
        with pytest.raises(RuntimeError, match="batch invariant"): hc_pre_fused(x, fn, base, scale, CFG)
        with pytest.raises(RuntimeError, match="batch invariant"): hc_post_fused(y0, x[:0], p0, c0)
        with pytest.raises(RuntimeError, match="batch invariant"): hc_head_fused(x, fn[:HC], base[:HC], scale[:1], CFG)


def test_drop_in_for_the_model(tiny_model):
    # the fused functions swapped into dspark.model.transformer leave the tiny model's logits unchanged
    from dspark.model import transformer as model_mod
    m = tiny_model if DEV == "cpu" else copy.deepcopy(tiny_model).to(DEV)
    ids = torch.randint(0, m.cfg.vocab_size, (1, 2), generator=torch.Generator().manual_seed(4)).to(DEV)
    swaps = {"hc_pre": hc_pre_fused, "hc_post": hc_post_fused, "hc_head": hc_head_fused}
    saved = {k: getattr(model_mod, k) for k in swaps}
    with torch.no_grad():
        want = m.logits(ids)
        try:
            for k, f in swaps.items(): setattr(model_mod, k, f)
            got = m.logits(ids)
        finally:
            for k, f in saved.items(): setattr(model_mod, k, f)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_three_streams():
    # hc = 3 is padded to four lanes in the kernels; the padding must stay out of the softmax and every sum
    g = torch.Generator().manual_seed(5)
    cfg, hc, D = dataclasses.replace(CFG, hc_mult=3), 3, 40
    fn = (torch.randn(15, hc * D, generator=g) / (hc * D) ** 0.5).to(DEV)
    base, scale = (0.5 * torch.randn(15, generator=g)).to(DEV), torch.tensor([0.7, 1.3, 4.0], device=DEV)
    x, out = torch.randn(2, hc, D, generator=g).to(DEV), torch.randn(2, D, generator=g).to(DEV)
    got, want = hc_pre_fused(x, fn, base, scale, cfg), layers.hc_pre(x, fn, base, scale, cfg)
    got += (hc_post_fused(out, x, got[1], got[2]), hc_head_fused(x, fn[:hc], base[:hc], scale[:1], cfg))
    want += (layers.hc_post(out, x, want[1], want[2]), layers.hc_head(x, fn[:hc], base[:hc], scale[:1], cfg))
    for a, b in zip(got, want): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hc,D,dtype,block_d", [(4, 100, torch.float32, 32), (4, 64, torch.bfloat16, None),
                                                (3, 40, torch.float32, 16)])
def test_in_place_and_fused_final(hc, D, dtype, block_d):
    # dst=x: the same bits as a fresh buffer (every program loads its columns of all streams before storing them);
    # the fused final: hc_head_fused of the expansion (fp32 rounding of the mixes) and the fp32 hc-mean of a tap
    g = torch.Generator().manual_seed(6)
    cfg = dataclasses.replace(CFG, hc_mult=hc)
    rows = (2 + hc) * hc
    fn = (torch.randn(rows, hc * D, generator=g) / (hc * D) ** 0.5).to(DEV)
    base, scale = (0.5 * torch.randn(rows, generator=g)).to(DEV), torch.tensor([0.7, 1.3, 1.0], device=DEV)
    x = torch.randn(2, 3, hc, D, generator=g).to(DEV, dtype)
    out = torch.randn(2, 3, D, generator=g).to(DEV, dtype)
    _, post, comb = hc_pre_fused(x, fn, base, scale, cfg)
    want = hc_post_fused(out, x, post, comb, block_d=block_d)
    xi = x.clone()
    assert hc_post_fused(out, xi, post, comb, block_d=block_d, dst=xi).data_ptr() == xi.data_ptr()
    assert torch.equal(xi, want)
    other = torch.empty_like(x)
    assert torch.equal(hc_post_fused(out, x, post, comb, dst=other), want) and torch.equal(other, want)
    rtol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for split in (True, False):        # column slices from partial mixes (decode sizes), or one program a token
        h, tap = hc_post_head_fused(out, x, post, comb, fn[:hc], base[:hc], scale[:1], cfg, tap=True, block_d=block_d,
                                    split=split)
        assert h.shape == (2, 3, D) and h.dtype == dtype and tap.shape == (2, 3, D) and tap.dtype == torch.float32
        torch.testing.assert_close(h, hc_head_fused(want, fn[:hc], base[:hc], scale[:1], cfg), rtol=rtol, atol=1e-5)
        torch.testing.assert_close(tap, want.mean(-2, dtype=torch.float32), rtol=1e-6, atol=1e-6)
    assert hc_post_head_fused(out, x, post, comb, fn[:hc], base[:hc], scale[:1], cfg)[1] is None
    assert aten_launches(hc_post_head_fused, out, x, post, comb, fn[:hc], base[:hc], scale[:1], cfg) == Counter(
        {"triton:_hc_post_mix_kernel": 1, "triton:_hc_post_apply_kernel": 1})     # 6 tokens: split
    assert aten_launches(hc_post_head_fused, out, x, post, comb, fn[:hc], base[:hc], scale[:1], cfg, split=False) == \
        Counter({"triton:_hc_post_head_kernel": 1})
    with pytest.raises(ValueError, match="dst must be contiguous"):
        hc_post_fused(out, x, post, comb, dst=torch.empty(2, 3, hc, D + 1, device=DEV, dtype=dtype))
    with pytest.raises(ValueError, match="fn must have shape"):
        hc_post_head_fused(out, x, post, comb, fn, base[:hc], scale[:1], cfg)
    with layers.batch_invariant():
        with pytest.raises(RuntimeError, match="batch invariant"):
            hc_post_head_fused(out, x, post, comb, fn[:hc], base[:hc], scale[:1], cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the tests above compile the kernels for real")
def test_post_head_kernels_compile_for_hopper():
    """The final post/head's kernels (split and one program a token) and the split collapse compiled for sm_90 with the signatures a GPU's
    JIT would see at V4-Flash width in bf16: the interpreter never compiles them."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kernel_compile import compile_all, record
    hc, D = 4, 4096
    cfg = dataclasses.replace(CFG, hc_mult=hc)
    g = torch.Generator().manual_seed(2)
    x, out = torch.randn(1, hc, D, generator=g).bfloat16(), torch.randn(1, D, generator=g).bfloat16()
    post, comb = torch.rand(1, hc, generator=g), torch.softmax(torch.randn(1, hc, hc, generator=g), -1)
    fn, base, scale = torch.randn(hc, hc * D, generator=g) / 128, torch.randn(hc, generator=g), torch.ones(1)
    rows = (2 + hc) * hc
    fn_pre, base_pre = torch.randn(rows, hc * D, generator=g) / 128, torch.randn(rows, generator=g)
    sigs = []
    with record(sigs):
        for split in (True, False): hc_post_head_fused(out, x, post, comb, fn, base, scale, cfg, tap=True, split=split)
        hc_pre_fused(x, fn_pre, base_pre, torch.ones(3), cfg)          # split mixes, the collapse over column slices
    assert {s[1] for s in sigs} == {"_hc_post_mix_kernel", "_hc_post_apply_kernel", "_hc_post_head_kernel",
                                    "_hc_mix_kernel", "_hc_collapse_kernel"}, sigs
    failed = compile_all(sigs)
    assert not failed, "\n".join(failed)


def test_collapse_over_column_slices_is_the_one_program_collapse(monkeypatch):
    "After split mixes, a token's columns spread over programs give the bits of one program a token (post and comb too)."
    import dspark.kernels.hc as khc
    g = torch.Generator().manual_seed(9)
    hc, D = 4, 96
    cfg = dataclasses.replace(CFG, hc_mult=hc)
    rows = (2 + hc) * hc
    fn, base = (torch.randn(rows, hc * D, generator=g) / (hc * D) ** 0.5).to(DEV), (0.5 * torch.randn(rows, generator=g)).to(DEV)
    x, scale = torch.randn(3, hc, D, generator=g).to(DEV, torch.bfloat16), torch.tensor([0.7, 1.3, 1.0], device=DEV)
    monkeypatch.setattr(khc, "COLLAPSE_SLICE", 1 << 30)
    whole = hc_pre_fused(x, fn, base, scale, cfg, split=True)
    monkeypatch.setattr(khc, "COLLAPSE_SLICE", 32)                    # three slices of 32 columns
    sliced = hc_pre_fused(x, fn, base, scale, cfg, split=True)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced))
