"""Chapters 18b and 18c's FP4 MoE launches against the reference at shapes the chapter does not use: a hidden size that is an
odd multiple of 128 (the GEMV's `KC` steps down to a divisor), a hash-routed repeat of one expert in a token, both
tile settings, an empty batch, and the grouped launches with the decode a device would use.

On a machine without CUDA the kernels run under Triton's interpreter (set before triton is imported)."""
import os

import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from dspark.kernels.fp4_grouped import GroupedTiles, fp4_moe, fp4_moe_grouped
from dspark.kernels.fp4_moe import FP4_GEMV, GemvTiles, fp4_case, fp4_down, fp4_down_ref, fp4_moe_small, fp4_up, fp4_up_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("tiles", [FP4_GEMV, GemvTiles(up_bn=8, up_kc=512, down_bn=16, down_kc=512)])
def test_gemv_launches_match_the_reference_at_an_odd_width(tiles):
    "D = 384 (3 x 128) and I = 256: `KC` 256 does not divide D, so the up launch walks D 128 at a time."
    g = torch.Generator().manual_seed(3)
    x, w, idx, st = fp4_case(3, 6, 8, 384, 256, 0, 8, g)
    idx[1] = idx[1, 0]                                      # a hash table may repeat an expert within a token
    x, w, idx = x.to(DEV), w.to(DEV), idx.to(DEV)
    st = type(st)(*(t.to(DEV) for t in (st.w13, st.s13, st.w2, st.s2)), ())
    t = tiles
    h, h_ref = fp4_up(x, w, idx, st, 0, 1.5, t), fp4_up_ref(x, w, idx, st, 0, 1.5)
    assert _rel(h, h_ref) <= 1e-5
    y, y_ref = fp4_down(h_ref, idx, st, 0, t), fp4_down_ref(h_ref, idx, st, 0)
    assert _rel(y, y_ref) <= 1e-5
    assert fp4_moe_small(x[:0], w[:0], idx[:0], st, 0, 1.5, t).shape == (0, 384)


def test_dispatch_and_grouped_decodes_agree():
    "`fp4_moe` (GEMV at this size) matches the reference; the grouped launches give bit-equal sums with either decode."
    g = torch.Generator().manual_seed(4)
    x, w, idx, st = fp4_case(4, 2, 4, 256, 128, 0, 4, g)
    x, w, idx = x.to(DEV), w.to(DEV), idx.to(DEV)
    st = type(st)(*(t.to(DEV) for t in (st.w13, st.s13, st.w2, st.s2)), ())
    ref = fp4_down_ref(fp4_up_ref(x, w, idx, st, 0, 1.5), idx, st, 0)
    outs = [fp4_moe(x, w, idx, st, 0, 1.5)] + [fp4_moe_grouped(x, w, idx, st, 0, 1.5, asm=a) for a in (False, True)]
    for y in outs:
        assert _rel(y, ref) <= 2e-2                       # one e4m3 flip of h allowed (chapter 18b), far below a wrong row
    assert torch.equal(outs[1], outs[2])                  # the Triton and PTX decodes give the same weights, exactly


@pytest.mark.parametrize("tiles", [GroupedTiles(16, 64, join=True), GroupedTiles(32, 128, 8, 2, 8, 2, True, True),
                                   GroupedTiles(16, 64, tile_first=True)])
def test_grouped_loop_forms_give_the_same_sums(tiles):
    """The grouped launches with the weight tile joined back into input order (one product a 128-block), with the
    output tile numbered first, and other warps and stages: the same sums as the two-product loop, up to fp32
    summation order, over blocks of several experts and a partial last tile."""
    g = torch.Generator().manual_seed(5)
    x, w, idx, st = fp4_case(9, 3, 6, 256, 256, 0, 6, g)
    x, w, idx = x.to(DEV), w.to(DEV), idx.to(DEV)
    st = type(st)(*(t.to(DEV) for t in (st.w13, st.s13, st.w2, st.s2)), ())
    base = fp4_moe_grouped(x, w, idx, st, 0, 1.5, tiles.bm, tiles.bn_down)
    assert _rel(fp4_moe_grouped(x, w, idx, st, 0, 1.5, tiles=tiles), base) <= 1e-5
    ref = fp4_down_ref(fp4_up_ref(x, w, idx, st, 0, 1.5), idx, st, 0)
    assert _rel(base, ref) <= 2e-2
