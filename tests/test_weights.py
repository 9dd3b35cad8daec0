"""Weights kept as stored (chapter 7a): FP8Linear/FP4Linear against the dequantised reference, `as_stored` against a
real FP8 checkpoint's tensors, resident bytes, greedy parity of `quantization="auto"` with the dequantised
reference through `dspark.LLM`, and dummy weights."""
import shutil

import pytest
import torch
import torch.nn.functional as F

import dspark
from dspark.config import load_config
from dspark.distributed.sharding import shard_block
from dspark.engine.args import EngineArgs
from dspark.model.checkpoint import make_tiny_checkpoint, read_tensors
from dspark.model.drafter import DSparkDrafter
from dspark.model.layers import set_moe_impl, stack_experts
from dspark.model.mtp import MTPDrafter
from dspark.model.quant import dequantize_fp4, dequantize_fp8, quantize_fp4, quantize_fp8
from dspark.model.transformer import Transformer
from dspark.model.weights import FP4Linear, FP8Linear, as_stored, dummy_weights, resident_bytes, scratch


def stored_state(path) -> dict[str, torch.Tensor]:
    "A checkpoint's tensors as stored, with today's `X.weight.scale` renamed to the shipped `X.scale`."
    return {(k.removesuffix(".weight.scale") + ".scale" if k.endswith(".weight.scale") else k): v
            for k, v in read_tensors(path).items()}

def load_fp8(path) -> Transformer:
    "An as-stored target filled with a checkpoint's tensors (no dequantisation)."
    with torch.device("meta"): m = as_stored(Transformer(load_config(path)))
    m.load_state_dict({k: v for k, v in stored_state(path).items() if not k.startswith("mtp.")}, assign=True)
    return m.eval()

@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("w") / "fp8", fmt="fp8", seed=0, drafter="dspark",
                                num_hidden_layers=4)      # SWA, SWA, CSA, HCA; hash and top-k routing

@pytest.fixture(scope="module")
def fp8_mtp(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("w") / "fp8_mtp", fmt="fp8", seed=1, drafter="mtp",
                                num_hidden_layers=4, compress_ratios=[0, 0, 4, 16, 0])

def sig(sd: dict) -> dict:
    return {k: (v.dtype, tuple(v.shape)) for k, v in sd.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(300, 200), (256, 128), (64, 384)])
def test_fp8_linear_equals_dequantised_reference(shape, dtype):
    O, I = shape
    g = torch.Generator().manual_seed(O + I)
    lin = FP8Linear(I, O)
    lin.weight.data, lin.scale.data = quantize_fp8(torch.randn(O, I, generator=g) * torch.logspace(-3, 0, I))
    x = torch.randn(5, 3, I, generator=g).to(dtype)
    ref = F.linear(x, dequantize_fp8(lin.weight, lin.scale).to(dtype))
    assert torch.equal(lin(x), ref)
    assert list(lin.state_dict()) == ["weight", "scale"]
    assert tuple(lin.scale.shape) == (-(-O // 128), -(-I // 128))


def test_one_shared_scratch_per_device_and_dtype():
    "Layers of every size dequantise into one buffer: once the widest has run, no call allocates a dense weight."
    g = torch.Generator().manual_seed(0)
    big, small, ex = FP8Linear(512, 640), FP8Linear(128, 256), FP4Linear(256, 384)
    for lin, (O, I) in ((big, (640, 512)), (small, (256, 128))):
        lin.weight.data, lin.scale.data = quantize_fp8(torch.randn(O, I, generator=g))
    ex.weight.data, ex.scale.data = quantize_fp4(torch.randn(384, 256, generator=g))
    x = torch.randn(2, 512, dtype=torch.bfloat16)
    big(x)
    ptr = scratch("dense", 1, torch.bfloat16, "cpu").data_ptr()
    for _ in range(2): small(x[:, :128]); ex(x[:, :256]); big(x)
    assert scratch("dense", 1, torch.bfloat16, "cpu").data_ptr() == ptr
    assert small.dequantized(torch.bfloat16).data_ptr() == ptr      # a view of the shared buffer, not a copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_linear_equals_dequantised_reference(dtype):
    g = torch.Generator().manual_seed(0)
    for O, I in [(96, 128), (128, 64), (40, 320)]:     # the scratch is shared: sizes up and down
        lin = FP4Linear(I, O)
        lin.weight.data, lin.scale.data = quantize_fp4(torch.randn(O, I, generator=g) * 0.1)
        x = torch.randn(7, I, generator=g).to(dtype)
        assert torch.equal(lin(x), F.linear(x, dequantize_fp4(lin.weight, lin.scale).to(dtype)))
        assert tuple(lin.weight.shape) == (O, I // 2) and tuple(lin.scale.shape) == (O, I // 32)


def test_as_stored_state_dict_is_the_checkpoints(fp8, fp8_mtp):
    for path, cls in ((fp8, DSparkDrafter), (fp8_mtp, MTPDrafter)):
        cfg = load_config(path)
        with torch.device("meta"):
            tgt = as_stored(Transformer(cfg))
            drafter = as_stored(cls(cfg, tgt))
        assert sig(tgt.state_dict()) | sig(drafter.state_dict()) == sig(stored_state(path))
    assert isinstance(tgt.layers[2].attn.indexer.wq_b, FP8Linear)
    assert isinstance(tgt.layers[0].ffn.experts[1].w2, FP4Linear)
    assert type(tgt.layers[2].attn.compressor.wkv) is torch.nn.Linear


def test_resident_bytes_are_the_stored_bytes(fp8):
    model = load_fp8(fp8)
    stored = sum(v.numel() * v.element_size() for k, v in read_tensors(fp8).items() if not k.startswith("mtp."))
    assert resident_bytes(model) == stored
    assert resident_bytes(model) == sum(p.numel() * p.element_size() for p in model.parameters()) + \
        sum(b.numel() * b.element_size() for b in model.buffers())
    dense = dspark.load_target(fp8, dtype="bfloat16")
    assert resident_bytes(model) < 0.6 * resident_bytes(dense)


def test_as_stored_logits_equal_the_dequantised_reference(fp8):
    ids = torch.randint(0, load_config(fp8).vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = load_fp8(fp8).logits(ids)
        b = dspark.load_target(fp8, dtype="bfloat16").logits(ids)
    assert torch.equal(a, b)


@pytest.mark.parametrize("ckpt,speculative", [("fp8", None), ("fp8", "dspark"), ("fp8_mtp", "mtp")])
def test_llm_greedy_tokens_auto_equal_none(ckpt, speculative, request):
    fp8 = request.getfixturevalue(ckpt)
    prompts = [[0, 17, 42, 99, 7], [0, 5, 6]]          # bf16 on a CPU is slow: a few tokens show the parity
    params = dspark.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for q in ("auto", "none"):
        llm = dspark.LLM(model=str(fp8), device="cpu", dtype="bfloat16", quantization=q, speculative=speculative,
                         num_speculative_tokens=2 if speculative == "dspark" else None)
        outs[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if q == "auto":
            assert isinstance(llm.engine.model.layers[1].attn.wo_a, FP8Linear)
            pr = llm.engine.runner.proposer
            if speculative: assert isinstance((getattr(pr, "drafter", None) or pr.mtp).mtp[0].attn.wq_b, FP8Linear)
        llm.close()
    assert outs["auto"] == outs["none"] and all(len(t) == 5 for t in outs["auto"])


def test_stored_experts_decline_stacking_and_shard_as_stored(fp8):
    model = load_fp8(fp8)
    with pytest.raises(TypeError, match="stored dtypes"): model.to(torch.float32)   # codes are not values
    assert set_moe_impl(model, "dense") == 0 and model.layers[0].ffn.impl == "loop"
    with pytest.raises(ValueError, match="kept as stored"): stack_experts(model.layers[0].ffn)
    shard_block(model.layers[0], 1, 2)                 # tensor parallelism slices stored codes with their scale blocks
    assert isinstance(model.layers[0].attn.wq_b, FP8Linear) and isinstance(model.layers[0].ffn.experts[0].w1, FP4Linear)


def test_dummy_weights(fp8, tmp_path):
    d = tmp_path / "dummy"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"): shutil.copy(fp8 / f, d / f)
    llm = dspark.LLM(model=str(d), device="cpu", quantization="auto", load_format="dummy", speculative=None, seed=5)
    model = llm.engine.model
    real = {k: v for k, v in stored_state(fp8).items() if not k.startswith("mtp.")}
    assert sig(model.state_dict()) == sig(real)
    out = llm.generate([[0, 11, 12, 13]], dspark.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    with torch.no_grad(): logits = model.logits(torch.tensor([[0, 11, 12, 13, 14, 15]]))
    assert torch.isfinite(logits).all() and logits.float().std() > 0
    llm.close()
    with torch.device("meta"): again = as_stored(Transformer(load_config(d)))
    dummy_weights(again, seed=5)                        # the same seed gives the same weights
    raw = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t
    assert all(torch.equal(raw(a), raw(b)) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    w = again.layers[3].attn.wq_b                       # dense weights at about 1/sqrt(fan_in)
    assert 0.5 < float(w.dequantized(torch.float32).square().mean().sqrt()) * w.in_features ** 0.5 < 2


def test_dummy_weights_dequantised(fp8, tmp_path):
    "`load_format='dummy'` with `quantization='none'`: dense random weights in --dtype (fp32 where the release keeps it)."
    d = tmp_path / "dummy"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"): shutil.copy(fp8 / f, d / f)
    llm = dspark.LLM(model=str(d), device="cpu", dtype="float32", load_format="dummy", speculative="dspark",
                     num_speculative_tokens=2)
    ref = dspark.load_target(fp8, dtype="float32")
    assert sig(llm.engine.model.state_dict()) == sig(ref.state_dict())
    out = llm.generate([[0, 11, 12]], dspark.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    llm.close()


def test_engine_args_carry_both_settings():
    args = EngineArgs(quantization="auto", load_format="dummy", device="cpu")
    kw = args.llm_kwargs()
    assert kw["quantization"] == "auto" and kw["load_format"] == "dummy"
    with pytest.raises(ValueError, match="quantization"): EngineArgs(quantization="fp8")


def test_grouped_linear_reads_the_stored_bytes_through_its_hook():
    """`grouped_linear` (V4's `wo_a`): the dense einsum without a hook; with `grouped` set, the grouped FP8 kernel's
    product (here the Triton interpreter), equal to `fp8_grouped_linear_ref` — the same activation quantisation —
    and close to the dense product (the activation's FP8 rounding is the only difference)."""
    from dspark.kernels.fp8 import fp8_grouped_linear_ref, fp8_linear_triton
    from dspark.model.weights import FP8Linear, grouped_linear
    from dspark.model.quant import quantize_fp8
    g = torch.Generator().manual_seed(3)
    lin = FP8Linear(256, 4 * 128)
    w, s = quantize_fp8(torch.randn(4 * 128, 256, generator=g) * 0.06)
    lin.weight.data.copy_(w); lin.scale.data.copy_(s)
    x = torch.randn(3, 4, 256, generator=g)
    with torch.no_grad():
        dense = grouped_linear(lin, x)
        lin.grouped = lambda x, w, s: fp8_linear_triton(x, w, s, groups=x.shape[-2])
        fast = grouped_linear(lin, x)
    assert fast.shape == dense.shape == (3, 4, 128)
    torch.testing.assert_close(fast, fp8_grouped_linear_ref(x, lin.weight, lin.scale), rtol=0, atol=1e-5)
    assert (fast - dense).abs().max() <= 0.05 * dense.abs().max()
    lin.grouped = lambda *a: None                          # a kernel that declines (too many rows): the dense path
    with torch.no_grad(): torch.testing.assert_close(grouped_linear(lin, x), dense)


def test_fp8_linears_that_read_one_input_stack_into_one_kernel_launch():
    """`stack_linears` over a layer's mixed x projections (two FP8, two bf16, one FP8 of a height that is not whole
    scale blocks): each kind of at least two stacks apart, every weight and scale becomes a view of its stack, the
    state dict is unchanged, the FP8 pair costs one launch of the FP8 kernel (here the Triton interpreter), and the
    outputs are those of the members one by one."""
    from torch import nn
    from dspark.kernels.fp8 import fp8_linear_triton
    from dspark.kernels.hc import aten_launches
    from dspark.model.layers import STACK, stack_linears, stacked_outputs
    g = torch.Generator().manual_seed(5)
    def fp8(O, I):
        lin = FP8Linear(I, O)
        lin.weight.data, lin.scale.data = quantize_fp8(torch.randn(O, I, generator=g) * I ** -0.5)
        lin.fast = fp8_linear_triton
        return lin
    owner = nn.Module()
    owner.a, owner.b, owner.c = fp8(256, 256), fp8(128, 256), fp8(200, 256)
    owner.d, owner.e = nn.Linear(256, 64, bias=False), nn.Linear(256, 32, bias=False)
    ls = [owner.a, owner.d, owner.b, owner.e, owner.c]
    x = torch.randn(3, 256, generator=g)
    with torch.no_grad():
        alone, state = [l(x) for l in ls], {k: v.clone() for k, v in owner.state_dict().items()}
        assert stack_linears(owner, ls)
        parts = owner.__dict__[STACK][0]
        assert [(type(W).__name__, idx) for W, _, idx in parts] == [("FP8Linear", [0, 2]), ("Tensor", [1, 3])]
        W = parts[0][0]
        assert owner.a.weight.data_ptr() == W.weight.data_ptr() and owner.b.scale.data_ptr() == W.scale[2:].data_ptr()
        assert owner.b.weight.data_ptr() == W.weight.data_ptr() + owner.a.weight.nbytes
        assert all(torch.equal(v, state[k]) for k, v in owner.state_dict().items())
        launches = aten_launches(lambda: stacked_outputs(owner, x, ls))
        assert launches["triton:_fp8_linear_kernel"] == 2          # the stacked pair once, the 200-row member alone
        for y, ref in zip(stacked_outputs(owner, x, ls), alone): torch.testing.assert_close(y, ref, rtol=0, atol=0)
