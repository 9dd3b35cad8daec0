"""Compile Triton kernels for a Hopper GPU on a machine without one.

CI runs every kernel under Triton's interpreter, which never compiles them: a kernel the compiler rejects (chapter
32's Markov kernel once did, for a variable that only the `k == 1` specialisation made loop-carried) passes every CPU
test and fails on the first GPU. Triton's wheel carries the whole compiler, ptxas included, so `record` notes the
signature of each interpreted launch as the GPU's JIT would specialise it (an integer equal to 1 becomes a constant),
and `compile_all` compiles those signatures for sm_90 in a child process where the kernels are real `triton.jit`
functions."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import torch

_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
           torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
           torch.float8_e4m3fn: "fp8e4nv"}


def signature(fn, args: tuple, kwargs: dict) -> list:
    """`[module, name, signature, constants, options]` of one launch of the Python function `fn`: tensors become
    typed pointers, integers i32 (i64 when large) or the constant 1, floats fp32, None a constant; keyword
    arguments that are parameters are the kernel's constexprs, the rest (num_warps, ...) compile options."""
    names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    sig, const = {}, {}
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor): sig[name] = "*" + _DTYPES[a.dtype]
        elif isinstance(a, bool): sig[name] = "i1"
        elif isinstance(a, int) and a == 1: sig[name], const[name] = "constexpr", 1
        elif isinstance(a, int): sig[name] = "i32" if -2**31 <= a < 2**31 else "i64"
        elif isinstance(a, float): sig[name] = "fp32"
        elif a is None: sig[name], const[name] = "constexpr", None
        else: raise TypeError(f"{fn.__name__}: argument {name} of type {type(a).__name__}")
    for name, v in kwargs.items():
        if name in names: sig[name], const[name] = "constexpr", v
    defaults = fn.__defaults__ or ()                      # parameters left at their defaults (constexprs such as GDC)
    for name, v in zip(names[len(names) - len(defaults):], defaults):
        if name not in sig: sig[name], const[name] = "constexpr", v
    opts = {k: v for k, v in kwargs.items() if k not in names}
    return [fn.__module__, fn.__name__, sig, const, opts]


@contextlib.contextmanager
def record(into: list):
    "Append the signature of every interpreted kernel launch inside the block to `into` (each distinct one once)."
    from triton.runtime.interpreter import InterpretedFunction
    run, seen = InterpretedFunction.run, {json.dumps(s, sort_keys=True) for s in into}
    def recording(self, *args, grid, warmup, **kwargs):
        s = signature(self.fn, args, kwargs)
        if (key := json.dumps(s, sort_keys=True)) not in seen:
            seen.add(key)
            into.append(s)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    InterpretedFunction.run = recording
    try: yield into
    finally: InterpretedFunction.run = run


def compile_all(sigs: list, arch: int = 90, timeout: float = 600) -> list[str]:
    "Compile `sigs` for `sm_{arch}` in a child process; the failures, one line each (empty when all compiled)."
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, __file__, str(arch)], input=json.dumps(sigs), env=env, text=True,
                       capture_output=True, timeout=timeout)
    if p.returncode != 0: return [f"the compiler's process failed: {p.stderr[-2000:]}"]
    return [l for l in p.stdout.splitlines() if l.startswith("FAILED")]


def _main(arch: int) -> None:
    "The child: kernels are real `triton.jit` functions here (dspark is told CUDA exists so it skips the interpreter)."
    import importlib
    torch.cuda.is_available = lambda: True
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    for module, name, sig, const, opts in json.load(sys.stdin):
        fn = getattr(importlib.import_module(module), name)
        try:
            triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", arch, 32), options=opts)
            print("compiled", name, json.dumps(const))
        except Exception as e:
            msg = " ".join(str(e).split())[-400:]
            print(f"FAILED {name} {json.dumps(const)}: {type(e).__name__}: {msg}")


if __name__ == "__main__":
    _main(int(sys.argv[1]))
