"""Programmatic dependent launch (chapter 12's `PDL`): which launches take it, that every kernel waits for the one
before it ahead of its first read or write (a kernel that did not could read its input before it is written), and
on a GPU that a CUDA-graph step launched with it decodes the plain launches' tokens."""
import ast
import gc
import importlib
import inspect
import pkgutil

import pytest
import torch

import dspark.kernels
from dspark.kernels.attention import PDL, pdl_options
from dspark.kernels.step import _rms_norm_kernel, pdl_check


def _kernels():
    "Every Triton kernel (a jitted function named *_kernel) of dspark.kernels, as (module, name, source)."
    for info in pkgutil.iter_modules(dspark.kernels.__path__):
        mod = importlib.import_module(f"dspark.kernels.{info.name}")
        for node in ast.parse(inspect.getsource(mod)).body:
            if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                yield info.name, node


def test_every_kernel_waits_before_it_reads_or_writes():
    found = list(_kernels())
    assert len(found) >= 30, [n.name for _, n in found]
    for mod, node in found:
        assert "GDC" in [a.arg for a in node.args.args], f"{mod}.{node.name} takes no GDC"
        body = [s for s in node.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert ast.unparse(body[0]) == "gdc_entry(GDC)", f"{mod}.{node.name} starts with {ast.unparse(body[0])!r}"


def test_launch_options_only_when_on_and_for_kernels_that_wait(monkeypatch):
    monkeypatch.setitem(PDL, "on", False)
    assert pdl_options(_rms_norm_kernel) == {}
    monkeypatch.setitem(PDL, "on", True)
    assert pdl_options(_rms_norm_kernel) == {"GDC": True, "launch_pdl": True}

    class Plain:                                        # a kernel without the GDC parameter never gets the option
        arg_names = ["x_ptr", "N"]
    assert pdl_options(Plain) == {}


def test_the_check_names_why_it_is_off_on_a_cpu():
    assert pdl_check(torch.device("cpu")) == "not a CUDA device"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("spec", [None, "dspark"])
def test_dependent_launches_decode_the_plain_launches_tokens(spec):
    import dspark
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    sp = dspark.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    got, allowed = {}, PDL["allowed"]
    try:
        for allowed in (False, True):
            PDL["allowed"] = allowed
            llm = dspark.LLM(speculative=spec, device="cuda", dtype="bfloat16", max_num_seqs=8,
                             kv_cache_memory_bytes=2 ** 30)   # a budget of its own: engines before it may hold memory
            got[PDL["on"]] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            del llm
            gc.collect(); torch.cuda.empty_cache()
    finally:
        PDL["allowed"] = allowed
    if True not in got: pytest.skip(f"programmatic dependent launch is off here: {pdl_check(torch.device('cuda'))}")
    assert got[True] == got[False]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the test above launches the GDC variants for real")
def test_dependent_launch_variants_compile_for_hopper():
    "The interpreter never compiles GDC=True (it is never on without a GPU): compile a norm and the FP8 GEMV that way."
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kernel_compile import compile_all, record
    from dspark.kernels.fp8 import fp8_linear_triton
    from dspark.kernels.step import rms_norm_fused
    from dspark.model.quant import quantize_fp8
    sigs = []
    with record(sigs):
        rms_norm_fused(torch.randn(2, 256), torch.ones(256), 1e-6)
        w, s = quantize_fp8(torch.randn(256, 256))
        fp8_linear_triton(torch.randn(1, 256), w, s)
    assert sigs and all(sig[3].get("GDC") is False for sig in sigs)
    for sig in sigs: sig[3]["GDC"] = True
    assert compile_all(sigs) == []
