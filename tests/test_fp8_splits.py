"""The split-K FP8 kernel (chapter 18a) with its partials summed by each tile's last program equals the same kernel
with the second launch summing them, bit for bit, plain and grouped, and leaves its tile counters at zero (a CUDA
graph replays the launch on the same counters). Off CUDA through the Triton interpreter."""
import os

import pytest
import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

from dspark.kernels import fp8 as F

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _weights(O: int, I: int, gen: torch.Generator):
    w = (torch.randn(O, I, generator=gen) * 0.05).clamp(-0.4, 0.4)
    scale = torch.full((O // 128, I // 128), 2.0 ** -4)
    q = (w / 2.0 ** -4).to(torch.float8_e4m3fn)
    return q.to(DEV), scale.to(torch.float8_e8m0fnu).to(DEV)


@pytest.mark.parametrize("M,O,I,groups", [(1, 256, 1024, 1), (3, 384, 2048, 1), (2, 256, 512, 2)])
def test_last_program_sums_equal_the_sum_launch(M, O, I, groups, monkeypatch):
    gen = torch.Generator().manual_seed(M * 7 + groups)
    w, s = _weights(groups * O, I, gen)
    shape = (M, groups, I) if groups > 1 else (M, I)
    x = torch.randn(*shape, generator=gen).to(DEV, torch.bfloat16)
    c = F.FP8Config(16, 128, 4, 4, 2)                     # four splits: the partials need summing
    monkeypatch.setattr(F, "FP8_LAST_SUMS", False)
    two = F.fp8_linear_triton(x, w, s, c, groups)
    monkeypatch.setattr(F, "FP8_LAST_SUMS", True)
    one = F.fp8_linear_triton(x, w, s, c, groups)
    assert torch.equal(one, two)
    assert torch.equal(F.fp8_linear_triton(x, w, s, c, groups), two)   # again, on the counters it left
    assert int(F._counters(x.device).abs().sum()) == 0
    ref = F.fp8_grouped_linear_ref(x, w, s) if groups > 1 else F.fp8_linear_ref(x, w, s)
    assert (one.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max() + 1e-3
