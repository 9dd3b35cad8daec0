"""Fused step kernels (nbs/15_kernels_step) against their torch references: chapter 22's `compress_tokens` +
`store_entries` for the compressor step, `RMSNorm` and `Gate`.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before anything
imports triton), at small shapes; on a GPU machine they run compiled.
"""
import os

import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from dspark.model.attention import Compressor
from dspark.config import preset
from dspark.cache.kv_cache import store_entries
from dspark.runtime.static import compress_tokens
from dspark.kernels.step import compress_chunks_, compress_step_, rms_norm_fused, router_fused, swiglu_fused
from dspark.cache.kv_cache import ring_size
from dspark.model.layers import Gate, RMSNorm, rope_inv_freq

DEV = "cuda" if torch.cuda.is_available() else "cpu"


class _Cache:
    "What `store_entries` needs of a `PagedKVCache`: a bf16/fp32 pool, a block size and a scratch block."
    def __init__(self, bs, scratch): self.cc, self.scratch_block = type("cc", (), {"block_size": bs, "fp8": False})(), scratch
    def write(self, pool, blk, rows, x, index=False): pool[blk, rows] = x.to(pool.dtype)


def _step(lens, starts, slots):
    "A ragged step: request i brings `lens[i]` tokens from `starts[i]`, ring slot `slots[i]`; two padding rows."
    req, pos, ring = [], [], []
    for i, (n, s, sl) in enumerate(zip(lens, starts, slots)):
        req += [i] * n; pos += list(range(s, s + n)); ring += [sl] * n
    req += [-1, -1]; pos += [-1, -1]; ring += [max(slots) + 1] * 2
    t = lambda v: torch.tensor(v, device=DEV)
    return t(req).int(), t(pos).int(), t(ring).long()


def _compressor(ratio, overlap, seed):
    "A `tiny`-config compressor (dim 32, random `ape` and norm weight), its 8-channel RoPE table, ring rows and width."
    torch.manual_seed(seed)
    cfg = preset("tiny")
    comp = Compressor(cfg, ratio, 32, overlap).to(DEV)
    with torch.no_grad():
        comp.ape.normal_(); comp.norm.weight.uniform_(0.5, 1.5)
    inv = rope_inv_freq(cfg, True).to(DEV)[: 4]                     # 8 rotary channels
    return cfg, comp, inv, ring_size(ratio, overlap, 5), comp.wkv.out_features


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_compress_step_matches_reference(ratio, overlap):
    """Several steps of a ragged batch (single tokens, verify-like runs of 3 and 5, a run that crosses two window
    ends): rings and pooled entries equal the reference's, including entries whose window mixes rows of this step
    (read from the projections) with rows of earlier steps (read from the ring)."""
    cfg, comp, inv, R, W = _compressor(ratio, overlap, seed=0)
    dim, bs = 32, 16
    slots, nb = 3, 12
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32, device=DEV)
    rings = [tuple(torch.zeros(slots + 1, R, W, device=DEV) for _ in range(2)) for _ in range(2)]
    pools = [torch.zeros(nb + 1, bs // ratio, dim, device=DEV) for _ in range(2)]
    starts = [0, 0, 0]
    for lens in ([7, 1, 3], [1, 5, 1], [1, 1, 6], [6, 3, 2], [1, 1, 1], [4, 6, 5]):
        req, pos, ring_slot = _step(lens, starts, [0, 1, 2])
        x = torch.randn(len(req), cfg.hidden_size, device=DEV)
        live = pos >= 0
        p = pos.long().clamp(min=0)
        with torch.no_grad():
            new, done = compress_tokens(comp, x, p, rings[0], ring_slot, inv)
            store_entries(_Cache(bs, nb), pools[0], tables, req, p, done & live, new, ratio)
            pool = pools[1].clone()                                  # rings as before the step: in-step rows must come from kv/score
            compress_step_(comp.wkv(x), comp.wgate(x), comp.ape, rings[1], ring_slot, req, pos, tables, pool,
                           comp.norm.weight, inv, ratio, overlap, bs, cfg.rms_norm_eps, write_ring=False)
            torch.testing.assert_close(pool[:nb], pools[0][:nb], rtol=2e-5, atol=2e-5)
            compress_step_(comp.wkv(x), comp.wgate(x), comp.ape, rings[1], ring_slot, req, pos, tables, pools[1],
                           comp.norm.weight, inv, ratio, overlap, bs, cfg.rms_norm_eps)
        starts = [s + n for s, n in zip(starts, lens)]
        for a, b in zip(rings[0], rings[1]):   # padding rows: the reference writes the scratch ring, the kernel skips them
            torch.testing.assert_close(b[:slots], a[:slots], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pools[1][:nb], pools[0][:nb], rtol=2e-5, atol=2e-5)
    assert pools[1][:nb].abs().sum() > 0 and not pools[1][nb].any()   # entries were written; padding wrote nothing


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_compress_chunks_matches_per_request_reference(ratio, overlap):
    """Eager steps with chunks longer than the ring (prefill): `compress_chunks_` over the whole ragged step against
    the reference `_compress_chunk` request by request — entries and the rings each step leaves behind."""
    from dspark.cache.kv_cache import _compress_chunk
    cfg, comp, inv, R, W = _compressor(ratio, overlap, seed=1)
    dim, bs = 32, 16
    slots, C = 3, 8
    tables = torch.arange(slots * C, dtype=torch.int32, device=DEV).view(slots, C)
    nb = slots * C
    rings = [tuple(torch.zeros(slots + 1, R, W, device=DEV) for _ in range(2)) for _ in range(2)]
    pools = [torch.zeros(nb + 1, bs // ratio, dim, device=DEV) for _ in range(2)]
    starts = [0, 0, 0]
    for lens in ([23, 9, 40], [1, 30, 5], [2 * R + 3, 1, 6]):
        assert max(lens) > R                                          # some chunk wraps the ring
        req, pos, ring_slot = _step(lens, starts, [0, 1, 2])
        ring_slot[-2:] = slots                                        # padding: the scratch ring
        last = torch.tensor([s + n - 1 for s, n in zip(starts, lens) for _ in range(n)] + [-1, -1], device=DEV)
        x = torch.randn(len(req), cfg.hidden_size, device=DEV)
        with torch.no_grad():
            a = 0
            for i, (s0, n) in enumerate(zip(starts, lens)):
                first, new = _compress_chunk(comp, x[None, a:a + n], s0, rings[0], i, inv)
                a += n
                if new is None: continue
                e = torch.arange(first, first + new.shape[1], device=DEV) * ratio
                pools[0][tables[i, e // bs].long(), (e % bs) // ratio] = new[0]
            compress_chunks_(comp, x, req, pos, ring_slot, last, tables, rings[1], pools[1], inv, bs, slots)
        starts = [s + n for s, n in zip(starts, lens)]
        for r0, r1 in zip(rings[0], rings[1]):
            torch.testing.assert_close(r1[:slots], r0[:slots], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pools[1][:nb], pools[0][:nb], rtol=2e-5, atol=2e-5)
    assert pools[1][:nb].abs().sum() > 0


def test_compress_step_rejects_bad_layouts():
    kv = torch.zeros(2, 8, device=DEV)
    ring = (torch.zeros(1, 8, 8, device=DEV), torch.zeros(1, 8, 8, device=DEV, dtype=torch.float64))
    z = torch.zeros(2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="rings"):
        compress_step_(kv, kv, kv, ring, z.long(), z, z, z[None], torch.zeros(1, 1, 8, device=DEV), kv[0], kv[0, :2], 4, False, 4, 1e-6)
    with pytest.raises(ValueError, match="row-major"):
        compress_step_(kv, kv.t().contiguous().t(), kv, ring, z.long(), z, z, z[None], torch.zeros(1, 1, 8, device=DEV), kv[0], kv[0, :2], 4, False, 4, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_fused_matches_module(dtype):
    torch.manual_seed(0)
    m = RMSNorm(48, 1e-6).to(DEV)
    with torch.no_grad(): m.weight.uniform_(0.5, 1.5)
    m = m.to(dtype)
    x = (torch.randn(3, 5, 48, device=DEV) * 3).to(dtype)
    with torch.no_grad(): ref = m(x)
    out = rms_norm_fused(x, m.weight, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    tol = dict(rtol=1.6e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    with pytest.raises(ValueError, match="weight"): rms_norm_fused(x, m.weight[:4], 1e-6)


@pytest.mark.parametrize("kind", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("hashed", [False, True])
def test_router_fused_matches_gate(kind, hashed):
    """Weights and expert ids equal `Gate.forward`'s, including ties (duplicated logits): the lower id wins."""
    torch.manual_seed(1)
    cfg = preset("tiny", scoring_func=kind, n_routed_experts=12, num_experts_per_tok=3)
    g = Gate(cfg, hashed).to(DEV)
    with torch.no_grad():
        g.weight.normal_()
        if hashed: g.tid2eid.copy_(torch.randint(0, 12, g.tid2eid.shape))
        else: g.bias.normal_(0, 0.1)
    x = torch.randn(9, cfg.hidden_size, device=DEV)
    x[1] = x[0]                                                         # identical rows
    ids = torch.randint(0, cfg.vocab_size, (9,), device=DEV)
    with torch.no_grad():
        if not hashed: g.weight[5] = g.weight[2]; g.bias[5] = g.bias[2]  # a tie between experts 2 and 5
        w0, i0 = g(x, ids)
        logits = torch.nn.functional.linear(x.float(), g.weight.float())
        w1, i1 = router_fused(logits, 3, kind, cfg.routed_scaling_factor, None if hashed else g.bias,
                              g.tid2eid if hashed else None, ids if hashed else None)
    assert torch.equal(i1, i0)
    torch.testing.assert_close(w1, w0, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scoring"): router_fused(logits, 3, "relu", 1.0, g.bias if not hashed else logits[0])


@pytest.mark.parametrize("weighted", [False, True])
def test_swiglu_fused_matches_expert(weighted):
    """The shared expert's forward with the fused activation equals the reference, and so does the grouped path's
    activation on the two halves of one GEMM output."""
    from dspark.model.layers import Expert, _swiglu
    torch.manual_seed(2)
    ex = Expert(32, 24, limit=1.5).to(DEV)
    x = torch.randn(7, 32, device=DEV) * 2
    w = torch.rand(7, 1, device=DEV) if weighted else None
    with torch.no_grad():
        ref = ex(x, w)
        ex.fast = swiglu_fused
        out = ex(x, w)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    h13 = torch.randn(5, 48, device=DEV) * 3
    wt = torch.rand(5, 1, device=DEV)
    torch.testing.assert_close(swiglu_fused(h13[:, :24], h13[:, 24:], 1.5, wt), _swiglu(h13, wt, 1.5), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="one \\[M, I\\] shape"): swiglu_fused(h13[:, :24], h13[:, :20], 1.5)
