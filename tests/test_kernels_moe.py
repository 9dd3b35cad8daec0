"""The small-MoE Triton kernels (nbs/18_kernels_moe) against `layers.dense_experts` and `layers.grouped_experts`. On a
machine without CUDA they run under Triton's interpreter at small shapes."""
import os

import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

from dspark.kernels.hc import aten_launches
from dspark.kernels.moe import SMALL_MOE_PAIRS, small_moe_check, small_moe_triton
from dspark.model.layers import StackedExperts, dense_experts, grouped_experts

DEV = "cuda" if torch.cuda.is_available() else "cpu"

# Tolerances, of the output's magnitude. fp32: the kernel sums the same products as the reference in another order,
# about 1e-7 apart. bf16: where a GEMV's and a GEMM's fp32 sums of gate, up or a pair's output fall either side of a
# rounding boundary, the rounded values are one bf16 unit (2^-8 relative) apart and that difference travels on; the
# sum of a token's k pairs can carry a few such units. 2e-2 is about five units; the largest seen here is ~one.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def case(N, k, E, D, I, first, n_experts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 100 * N + D)
    x = torch.randn(N, D, generator=g).to(dtype).to(DEV)
    w13 = (D ** -0.5 * torch.randn(E, 2 * I, D, generator=g)).to(dtype).to(DEV)
    w2 = (I ** -0.5 * torch.randn(E, D, I, generator=g)).to(dtype).to(DEV)
    idx = torch.randint(0, n_experts, (N, k), generator=g).to(DEV)
    weights = torch.rand(N, k, generator=g).to(DEV)
    return x, weights, idx, StackedExperts(w13, w2, ())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,k,E,D,I,first,n_experts", [
    (5, 2, 4, 72, 40, 2, 8),       # an expert-parallel shard: experts 2..5 of 8, the other pairs belong elsewhere
    (1, 2, 8, 64, 32, 0, 8),       # a decode step of one request, every expert here
    (5, 2, 8, 48, 24, 0, 8),       # a draft block of 5 tokens, top-2 of 8 (the embedded model's routing)
    (3, 4, 3, 100, 24, 1, 6),      # top-4, a shard in the middle
    (2, 2, 4, 37, 19, 0, 4),       # hidden and expert sizes that are odd
])
def test_equals_the_references(N, k, E, D, I, first, n_experts, dtype):
    x, w, idx, st = case(N, k, E, D, I, first, n_experts, dtype)
    outside = (idx < first) | (idx >= first + E)
    w[outside] = float("nan")                        # another rank's weights must not leak into this rank's sum
    y = small_moe_triton(x, w, idx, st.w13, st.w2, first, 1.5)
    ref = dense_experts(x, w, idx, st, first, 1.5)
    tol = TOL[dtype] * max(1.0, ref.abs().max().item())
    assert y.dtype == torch.float32 and y.shape == (N, D)
    assert (y - ref).abs().max().item() <= tol, (y - ref).abs().max()
    if D * x.element_size() % 16 == 0 and I * x.element_size() % 16 == 0:   # grouped_mm's 16-byte strides
        grouped = grouped_experts(x, w, idx, st, first, 1.5)
        assert (y - grouped).abs().max().item() <= tol, (y - grouped).abs().max()


def test_two_launches_and_nothing_else():
    "What a GPU would launch: the two Triton kernels; `h` and `y` are allocations, which launch nothing."
    x, w, idx, st = case(5, 2, 8, 48, 24, 0, 8, torch.bfloat16)
    fast = aten_launches(small_moe_triton, x, w, idx, st.w13, st.w2, 0, 10.0)
    assert fast == {"triton:_small_moe_up_kernel": 1, "triton:_small_moe_down_kernel": 1}, fast
    assert sum(aten_launches(grouped_experts, x, w, idx, st, 0, 10.0, whole=True).values()) > 10
    assert 5 * 2 <= SMALL_MOE_PAIRS


def test_empty_and_strided_inputs():
    "No tokens: an empty result and no launch. Router outputs that are views of wider tensors are read in place."
    x, w, idx, st = case(3, 2, 4, 40, 24, 0, 4, torch.float32)
    assert small_moe_triton(x[:0], w[:0], idx[:0], st.w13, st.w2, 0, 1.5).shape == (0, 40)
    assert aten_launches(small_moe_triton, x[:0], w[:0], idx[:0], st.w13, st.w2, 0, 1.5) == {}
    wide_w, wide_i = torch.stack([w, w], -1)[..., 0], torch.stack([idx, idx], -1)[..., 0]   # strides (4, 2)
    xs = torch.cat([x, x], 1)[:, :40]                                            # row stride 80
    y = small_moe_triton(xs, wide_w, wide_i, st.w13, st.w2, 0, 1.5)
    assert torch.allclose(y, dense_experts(x, w, idx, st, 0, 1.5), atol=1e-4)


def test_bad_shapes_raise():
    x, w, idx, st = case(3, 2, 4, 40, 24, 0, 4, torch.float32)
    with pytest.raises(ValueError, match=r"w13 must be \[E, 2I, D\]"):
        small_moe_triton(x, w, idx, st.w2, st.w13, 0, 1.5)                      # the stacks swapped
    with pytest.raises(ValueError, match=r"weights and idx must both be \[N, k\]"):
        small_moe_triton(x, w[:, :1], idx, st.w13, st.w2, 0, 1.5)
    with pytest.raises(ValueError, match=r"x must be \[N, D\]"):
        small_moe_triton(x[None], w, idx, st.w13, st.w2, 0, 1.5)
    with pytest.raises(ValueError, match="must share one dtype"):
        small_moe_triton(x.bfloat16(), w, idx, st.w13, st.w2, 0, 1.5)
    with pytest.raises(ValueError, match="integer expert ids"):
        small_moe_triton(x, w, idx.float(), st.w13, st.w2, 0, 1.5)


def test_check_passes_and_catches_a_wrong_kernel(monkeypatch):
    "`small_moe_check` passes the kernel, fails one that is 1% off, and turns a compile error into its message."
    import dspark.kernels.moe as km
    assert small_moe_check(DEV, torch.float32) is None
    assert small_moe_check(DEV, torch.bfloat16) is None
    good = km.small_moe_triton
    monkeypatch.setattr(km, "small_moe_triton", lambda *a: good(*a) * 1.01)
    assert "differs from dense_experts" in small_moe_check(DEV, torch.float32)
    def broken(*a): raise RuntimeError("PTX assembly failed")
    monkeypatch.setattr(km, "small_moe_triton", broken)
    assert small_moe_check(DEV, torch.float32) == "RuntimeError: PTX assembly failed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test above compiles the kernels for real")
def test_kernels_compile_for_hopper():
    """The interpreter never compiles a kernel, so both are compiled here for sm_90 with the signatures the GPU's JIT
    would see: the check at the embedded model's sizes in bf16 (sizes that divide by 16), and odd sizes in fp32 with
    top-1 routing (the JIT turns k = 1 into a constant, so the pair loop is its own specialisation)."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kernel_compile import compile_all, record
    sigs = []
    with record(sigs):
        assert small_moe_check("cpu", torch.bfloat16, dim=256, inter=96) is None
        x, w, idx, st = case(2, 1, 4, 37, 19, 1, 6, torch.float32)
        small_moe_triton(x.cpu(), w.cpu(), idx.cpu(), st.w13.cpu(), st.w2.cpu(), 1, 1.5)
    assert {s[1] for s in sigs} == {"_small_moe_up_kernel", "_small_moe_down_kernel"}, sigs
    assert any(s[3].get("K") == 1 for s in sigs)
    failed = compile_all(sigs)
    assert not failed, "\n".join(failed)


def test_moe_layer_takes_the_kernel_for_small_steps():
    """A MoE layer given the kernel (as `graphs.fast_path` does on a GPU) runs its routed experts in the two launches
    for up to `small_pairs` pairs, equal to its own sync-free path, and leaves larger steps to that path."""
    from dspark.config import preset
    from dspark.model.layers import MoE, set_moe_impl
    torch.manual_seed(0)
    cfg = preset("tiny", num_experts_per_tok=2)
    moe = MoE(cfg, layer_id=cfg.num_hidden_layers - 1).to(DEV)          # the last layer: routed by score, not hash
    with torch.no_grad():                                               # the module is built empty (a checkpoint fills it)
        for prm in moe.parameters(): prm.normal_(0, 0.1)
    set_moe_impl(moe, "dense")
    D = cfg.hidden_size
    x = torch.randn(5, D, device=DEV)
    with torch.no_grad():
        ref = moe.partial(x, None)
        moe.small, moe.small_pairs = small_moe_triton, 10
        got, ops = moe.partial(x, None), aten_launches(moe.partial, x, None)
        big = aten_launches(moe.partial, torch.randn(6, D, device=DEV), None)   # 12 pairs > 10: the dense path
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert ops["triton:_small_moe_up_kernel"] == ops["triton:_small_moe_down_kernel"] == 1, ops
    assert not any(k.startswith("triton:_small_moe") for k in big), big


def test_small_moe_pairs_keeps_the_counts_where_the_kernel_wins():
    """`small_moe_pairs` times the kernel against the layer's own path at 1, 2, 4, … tokens and keeps the pair counts
    before the first loss (the timer stands in for the device's graphs; the calls are real)."""
    from dspark.config import preset
    from dspark.kernels.moe import small_moe_pairs
    from dspark.model.layers import MoE, set_moe_impl
    cfg = preset("tiny", num_experts_per_tok=2)
    moe = MoE(cfg, layer_id=cfg.num_hidden_layers - 1).to(DEV)
    with torch.no_grad():
        for prm in moe.parameters(): prm.normal_(0, 0.1)
    set_moe_impl(moe, "dense")
    moe.small, moe.small_pairs = small_moe_triton, 99          # set already: the reference timed must still be the layer's
    def timer_of(costs):
        seen = []
        def timer(fn):
            ops = aten_launches(fn)
            seen.append(ops["triton:_small_moe_up_kernel"] == 1)
            return costs[len(seen) - 1]
        return timer, seen
    timer, seen = timer_of([1, 2, 1, 2, 1, 2, 5, 2])          # wins at 1, 2 and 4 tokens, loses at 8
    assert small_moe_pairs(moe, timer=timer) == 8 and seen == [True, False] * 4
    timer, _ = timer_of([3, 2])                                 # loses at one token: never
    assert small_moe_pairs(moe, timer=timer) == 0
    timer, seen = timer_of([1, 2] * 10)                         # wins everywhere: up to the bound
    assert small_moe_pairs(moe, most=16, timer=timer) == 16 and len(seen) == 8
    assert moe.small is small_moe_triton
