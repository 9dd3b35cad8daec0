"""The sync-free MoE paths (dspark.model.layers: stack_experts, grouped_experts, dense_experts, set_moe_impl): they equal the
reference loop for top-k and hash routing, duplicate experts, one token and experts left without tokens, in fp32 and
bf16; two expert-parallel shards sum to the whole; stacking shares storage and survives .to(), deepcopy, sharding and
load_state_dict; the default and batch-invariant results stay bitwise those of the reference loop."""
import copy

import pytest
import torch
from torch import nn

from dspark.config import preset
from dspark.model.layers import MOE_IMPLS, MoE, batch_invariant, set_moe_impl, stack_experts
from dspark.distributed.sharding import shard_moe

CFG = preset("tiny")                                         # D=256, I=128, 8 experts, k=2; layers 0-2 hashed
FAST = ("grouped", "dense")
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_moe(layer_id: int, dtype=torch.float32, seed: int = 0, distinct: bool = True) -> MoE:
    "A tiny MoE with random weights; hash layers get a table of k distinct (or, `distinct=False`, repeated) experts."
    g = torch.Generator().manual_seed(seed)
    m = MoE(CFG, layer_id)
    with torch.no_grad():
        for p in m.parameters(): p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        if m.gate.hashed:
            E, k = CFG.n_routed_experts, CFG.num_experts_per_tok
            t = torch.rand(CFG.vocab_size, E, generator=g).argsort(-1)[:, :k]
            m.gate.tid2eid.copy_(t if distinct else t[:, :1].expand(-1, k))
    return m.to(dtype)


def reference_partial(m: MoE, x, ids):
    "The loop as it was before the sync-free paths existed (a frozen copy: the default must stay bitwise equal to it)."
    x = x.reshape(-1, x.shape[-1])
    weights, idx = m.gate(x, ids)
    out = m.shared_experts(x).float()
    for e in idx.unique().tolist():
        if not m.first <= e < m.first + len(m.experts): continue
        tok, slot = (idx == e).nonzero(as_tuple=True)
        out.index_add_(0, tok, m.experts[e - m.first](x[tok], weights[tok, slot, None]).float())
    return out


def inputs(n: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, CFG.hidden_size, generator=g).to(dtype), torch.randint(0, CFG.vocab_size, (n,), generator=g)


def close(a, b, tol):
    scale = b.abs().max().clamp_min(1e-30)
    assert ((a - b).abs().max() / scale).item() <= tol, ((a - b).abs().max() / scale).item()


@torch.no_grad()
def run(m: MoE, impl: str, x, ids):
    set_moe_impl(m, impl)
    try: return m.partial(x, ids)
    finally: set_moe_impl(m, "loop")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layer_id", [0, 5], ids=["hash", "topk"])
def test_fast_paths_equal_the_loop(dtype, layer_id):
    m = make_moe(layer_id, dtype)
    for n in (0, 1, 3, 48, 8):
        x, ids = inputs(n, dtype)
        if n == 8:                                           # large activations: the SwiGLU clamps (±10) bite
            x = x * 400
            assert m.experts[0].w3(x).float().abs().max() > 2 * CFG.swiglu_limit
        with torch.no_grad(): ref = m.partial(x, ids)
        if n == 3: assert m.gate(x, ids)[1].unique().numel() < CFG.n_routed_experts   # some experts get no token
        for impl in FAST:
            out = run(m, impl, x, ids)
            assert out.dtype == torch.float32 and out.shape == (n, CFG.hidden_size)
            if n: close(out, ref, TOL[dtype])


def test_a_token_routed_twice_to_one_expert():
    m = make_moe(0, distinct=False)                          # hash table rows like [e, e]
    x, ids = inputs(16)
    assert (m.gate(x, ids)[1][:, 0] == m.gate(x, ids)[1][:, 1]).all()
    with torch.no_grad(): ref = m.partial(x, ids)
    for impl in FAST: close(run(m, impl, x, ids), ref, TOL[torch.float32])


@pytest.mark.parametrize("layer_id", [0, 5], ids=["hash", "topk"])
def test_expert_parallel_shards_sum_to_the_whole(layer_id):
    m = make_moe(layer_id)
    x, ids = inputs(24)
    with torch.no_grad(): full = m.partial(x, ids)
    set_moe_impl(m, "grouped")                               # stacked before sharding: the shards restack on their own
    for impl in FAST:
        parts = []
        for rank in (0, 1):
            shard = copy.deepcopy(m)
            shard_moe(shard, rank, 2)
            assert shard.first == 4 * rank and len(shard.experts) == 4
            shard.impl = impl
            with torch.no_grad(): parts.append(shard.partial(x, ids))
            with torch.no_grad(): close(parts[-1], reference_partial(shard, x, ids), TOL[torch.float32])
        close(parts[0] + parts[1], full, TOL[torch.float32])


def test_default_and_batch_invariant_results_are_the_reference_bit_for_bit():
    m = make_moe(5)
    x, ids = inputs(9)
    with torch.no_grad():
        before = reference_partial(m, x, ids)
        assert torch.equal(m.partial(x, ids), before)                    # default impl: the loop
        set_moe_impl(m, "loop"); stack_experts(m)
        assert torch.equal(m.partial(x, ids), before)                    # the loop over stacked views
        with batch_invariant(): bi = m(x[None], ids[None])
        for impl in FAST:
            m.impl = impl
            with batch_invariant(): assert torch.equal(m(x[None], ids[None]), bi)   # batch-invariant keeps the loop


def test_stacking_shares_storage_and_follows_the_parameters(tmp_path):
    m = make_moe(5)
    x, ids = inputs(12)
    with torch.no_grad(): ref = m.partial(x, ids)
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    st = stack_experts(m)
    assert stack_experts(m) is st                            # live stacks are reused
    base = st.w13.untyped_storage().data_ptr()
    for e, ex in enumerate(m.experts):
        assert ex.w1.weight.untyped_storage().data_ptr() == base == ex.w3.weight.untyped_storage().data_ptr()
        assert ex.w2.weight.untyped_storage().data_ptr() == st.w2.untyped_storage().data_ptr()
        assert torch.equal(ex.w3.weight, st.w13[e, CFG.moe_intermediate_size:])
    assert isinstance(m.experts[0].w1.weight, nn.Parameter)
    assert {k: v for k, v in m.state_dict().items()}.keys() == sd.keys()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())
    # load_state_dict writes through the views into the stacks
    new = {k: v * 2 if ".experts." in k else v for k, v in sd.items()}
    m.load_state_dict(new)
    assert torch.equal(st.w13[3, :CFG.moe_intermediate_size], new["experts.3.w1.weight"])
    m.load_state_dict(sd)
    # .to(dtype) restacks at once; a deepcopy restacks on its first fast call
    m.to(torch.float64)
    st64 = m._stacked
    assert st64.w13.dtype == torch.float64 and m.experts[5].w2.weight.data_ptr() == st64.w2[5].data_ptr()
    m.to(torch.float32)
    twin = copy.deepcopy(m)
    assert run(twin, "grouped", x, ids).shape == ref.shape
    assert twin.experts[0].w1.weight.data_ptr() == twin._stacked.w13.data_ptr() != m._stacked.w13.data_ptr()
    close(run(twin, "grouped", x, ids), ref, 1e-5)
    # safetensors accepts non-overlapping views of one storage
    from safetensors.torch import load_file, save_file
    save_file(m.state_dict(), tmp_path / "moe.safetensors")
    assert torch.equal(load_file(tmp_path / "moe.safetensors")["experts.7.w2.weight"], sd["experts.7.w2.weight"])


def test_set_moe_impl_validates_and_reaches_every_moe():
    ms = nn.ModuleList([make_moe(0), make_moe(5)])
    with pytest.raises(ValueError, match="loop, grouped, dense.*'fast'"): set_moe_impl(ms, "fast")
    assert set_moe_impl(ms, "dense") == 2 and all(m.impl == "dense" and "_stacked" in m.__dict__ for m in ms)
    ms[1].impl = "bogus"
    with pytest.raises(ValueError, match="bogus"), torch.no_grad(): ms[1].partial(*inputs(2))
    assert MOE_IMPLS == ("loop", "grouped", "dense")


def test_training_keeps_the_loop_so_gradients_reach_the_experts():
    m = make_moe(5)
    set_moe_impl(m, "grouped")
    x, ids = inputs(6)
    m.partial(x, ids).square().sum().backward()
    assert sum(ex.w1.weight.grad is not None for ex in m.experts) > 0


def test_grouped_names_misaligned_sizes():
    cfg = preset("tiny", moe_intermediate_size=6)
    m = MoE(cfg, 5)
    for p in m.parameters(): nn.init.normal_(p, std=0.05)
    x = torch.randn(4, cfg.hidden_size)
    set_moe_impl(m, "grouped")
    with pytest.raises(ValueError, match="multiples of 4.*impl='dense'"), torch.no_grad(): m.partial(x, None)
    m.impl = "dense"
    with torch.no_grad(): close(m.partial(x, None), reference_partial(m, x, None), 1e-5)


def test_whole_model_logits(tiny_model):
    model = copy.deepcopy(tiny_model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad(): ref = model.logits(ids)
    for impl in FAST:
        assert set_moe_impl(model, impl) == CFG.num_hidden_layers
        with torch.no_grad(): close(model.logits(ids), ref, 1e-5)


@pytest.mark.parametrize("impl", ["loop", "grouped"])
def test_route_rounds_once_into_the_input_dtype(impl):
    # `route` asks `partial` for x's dtype: the fp32 sum rounded once, equal to rounding the fp32 partial
    m = make_moe(3, torch.bfloat16)
    set_moe_impl(m, impl)
    x = torch.randn(5, CFG.hidden_size, generator=torch.Generator().manual_seed(7)).bfloat16()
    with torch.no_grad():
        full = m.partial(x, None)
        assert full.dtype == torch.float32
        assert torch.equal(m.route(x, None), full.to(torch.bfloat16))


def test_paired_shared_expert_is_one_gemm_with_the_same_output():
    from dspark.kernels.hc import aten_launches
    from dspark.kernels.step import swiglu_fused
    from dspark.model.layers import STACK, stack_linears
    dev = "cuda" if torch.cuda.is_available() else "cpu"     # the kernel: compiled, or Triton's CPU interpreter
    m = make_moe(3).to(dev)
    ex = m.shared_experts
    x = torch.randn(4, CFG.hidden_size, generator=torch.Generator().manual_seed(8)).to(dev)
    ex.fast = swiglu_fused
    with torch.no_grad():
        before, state = ex(x), {k: v.clone() for k, v in ex.state_dict().items()}
        assert stack_linears(ex, (ex.w1, ex.w3))
        (w13, widths, idx), = ex.__dict__[STACK][0]
        assert ex.w1.weight.data_ptr() == w13.data_ptr()                       # views, nothing stored twice
        assert ex.w3.weight.data_ptr() == w13.data_ptr() + ex.w1.weight.nbytes
        assert all(torch.equal(v, state[k]) for k, v in ex.state_dict().items())
        assert stack_linears(ex, (ex.w1, ex.w3)) and ex.__dict__[STACK][0][0][0] is w13   # a live stack is kept
        mm = lambda x: aten_launches(ex, x)["mm"]
        assert mm(x) == 2                                                     # w13, then w2
        torch.testing.assert_close(ex(x), before, rtol=1e-5, atol=1e-6)
        ex.to(torch.float64)                                                  # a move: separate storage again
        assert mm(x.double()) == 3 and STACK not in ex.__dict__               # the stale stack is dropped
        ex.fast = None
