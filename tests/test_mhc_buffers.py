"""The mHC buffer reductions (`dspark.model.mhc`: FUSE_FINAL, INPLACE_POST, PINGPONG) against the plain path: the
reference torch functions bit-equal, the fused Triton ones (the interpreter on a machine without CUDA) bit-equal for
the written-into expansions and within fp32 rounding for the fused final; the bytes they save and the memory plan."""
import os

import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import copy
import itertools

import pytest

from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, forward_cached
from dspark.config import preset
from dspark.model import mhc
from dspark.model.layers import hc_head, hc_post, hc_pre

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FLAGS = ("FUSE_FINAL", "INPLACE_POST", "PINGPONG")


def _step(model, ids, taps, mhc_fns, finals=None):
    cc = CacheConfig(block_size=32, num_blocks=8, num_window_blocks=8, max_seqs=2)
    cache = PagedKVCache(model.cfg, cc, device=ids.device)
    feats = []
    chunks, seqs = [ids[:5], ids[5:9]], [SeqView([0, 1], [0, 1], 0, 0), SeqView([2, 3], [2, 3], 1, 0)]
    logits = forward_cached(model, cache, chunks, seqs, taps, feats, finals, mhc=mhc_fns)
    return torch.cat(logits), torch.cat(feats)


def _with(monkeypatch, on):
    for f, v in zip(FLAGS, on): monkeypatch.setattr(mhc, f, v)


@pytest.mark.parametrize("on", list(itertools.product((False, True), repeat=3)))
def test_reference_path_bit_equal(tiny_model, monkeypatch, on):
    # two requests, taps on an inner and on the last layer (which the fused final serves)
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(1))
    taps = (1, tiny_model.cfg.num_hidden_layers - 1)
    _with(monkeypatch, (False,) * 3)
    want = _step(tiny_model, ids, taps, (hc_pre, hc_post, hc_head))
    want_finals = []
    _step(tiny_model, ids, taps, (hc_pre, hc_post, hc_head), want_finals)
    _with(monkeypatch, on)
    got = _step(tiny_model, ids, taps, (hc_pre, hc_post, hc_head))
    finals = []
    got_f = _step(tiny_model, ids, taps, (hc_pre, hc_post, hc_head), finals)
    for a, b in zip(got + got_f, want + want):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip(finals, want_finals))


def test_stream_ops_choices(monkeypatch):
    _with(monkeypatch, (True, True, True))
    with torch.no_grad():
        ops = mhc.stream_ops(hc_post, hc_head)
        assert ops.inplace and not ops.pingpong and ops.post_head is mhc.hc_post_head
        assert mhc.stream_ops(hc_post, hc_head, finals=True).post_head is None       # MTP needs the streams
        assert mhc.stream_ops(hc_post, lambda *a: None).post_head is None           # another head: no fusion
        assert mhc.stream_ops(lambda *a: None, hc_head) == mhc.StreamOps()          # unknown post: the plain path
        monkeypatch.setattr(mhc, "INPLACE_POST", False)
        ops = mhc.stream_ops(hc_post, hc_head)
        assert ops.pingpong and not ops.inplace and ops.into is mhc.hc_post_into
    assert mhc.stream_ops(hc_post, hc_head) == mhc.StreamOps()                      # autograd on: nothing in place


def test_pingpong_allocates_no_buffer_per_layer(monkeypatch):
    # after the first expansion the two buffers alternate; in place, the input's own storage is written
    cfg = preset("tiny")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, cfg.hc_mult, 16, generator=g)
    out, post = torch.randn(3, 16, generator=g), torch.rand(3, cfg.hc_mult, generator=g)
    comb = torch.rand(3, cfg.hc_mult, cfg.hc_mult, generator=g)
    _with(monkeypatch, (True, False, True))
    with torch.no_grad():
        ops, spare, ptrs = mhc.stream_ops(hc_post), None, []
        for _ in range(4):
            x, spare = mhc.expand(ops, hc_post, out, x, post, comb, spare)
            ptrs.append(x.data_ptr())
        assert ptrs[0] == ptrs[2] and ptrs[1] == ptrs[3] and ptrs[0] != ptrs[1]
        monkeypatch.setattr(mhc, "INPLACE_POST", True)
        ops, p = mhc.stream_ops(hc_post), x.data_ptr()
        want = hc_post(out, x, post, comb)
        x, _ = mhc.expand(ops, hc_post, out, x, post, comb, None)
        assert x.data_ptr() == p and torch.equal(x, want)


def test_fused_path(tiny_model, monkeypatch):
    pytest.importorskip("triton")
    from dspark.kernels.hc import hc_head_fused, hc_post_fused, hc_pre_fused
    fused = (hc_pre_fused, hc_post_fused, hc_head_fused)
    m = tiny_model if DEV == "cpu" else copy.deepcopy(tiny_model).to(DEV)
    ids = torch.randint(0, 512, (9,), generator=torch.Generator().manual_seed(3)).to(DEV)
    taps = (2, m.cfg.num_hidden_layers - 1)
    n = torch.get_num_threads(); torch.set_num_threads(1)
    try:
        _with(monkeypatch, (False,) * 3)
        want = _step(m, ids, taps, fused)
        _with(monkeypatch, (False, True, False))
        assert all(torch.equal(a, b) for a, b in zip(_step(m, ids, taps, fused), want))     # in place: the same bits
        _with(monkeypatch, (False, False, True))
        assert all(torch.equal(a, b) for a, b in zip(_step(m, ids, taps, fused), want))     # ping-pong: the same bits
        _with(monkeypatch, (True, True, True))
        got = _step(m, ids, taps, fused)                    # the final's head mixes sum in another order: fp32 rounding
        for a, b in zip(got, want): torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    finally: torch.set_num_threads(n)


def test_bytes_saved_and_the_plan():
    from dspark.config import load_config, named_configs
    from dspark.distributed.plan import plan_lines, plan_memory
    cfg = load_config(named_configs()["deepseek-v4-flash"])
    buf = 2048 * cfg.hc_mult * cfg.hidden_size * 2
    on = dict.fromkeys(mhc.REDUCTIONS, True)
    assert mhc.mhc_bytes_saved(cfg, 2048, 2, on) == {"fuse_final": buf, "inplace_post": buf, "pingpong": 0}
    assert mhc.mhc_bytes_saved(cfg, 2048, 2, on, finals=True)["fuse_final"] == 0
    assert mhc.peak_bytes_saved(cfg, 2048, 2, on) == buf
    assert sum(mhc.mhc_bytes_saved(cfg, 2048, 2, dict.fromkeys(mhc.REDUCTIONS, False)).values()) == 0
    kw = dict(tp=2, gpu_memory=141 * 10**9, max_model_len=65536, max_num_seqs=16, max_num_batched_tokens=8192,
              kv_cache_dtype="fp8")
    off, with_ = plan_memory(cfg, mhc_reductions=False, **kw), plan_memory(cfg, mhc_reductions=True, **kw)
    assert off.activations - with_.activations == mhc.peak_bytes_saved(cfg, 8192, 2, on)
    assert with_.kv_tokens > off.kv_tokens and with_.mhc_kv_tokens == with_.kv_tokens - off.kv_tokens
    assert any("mHC" in line for line in plan_lines(with_))


def test_a_device_whose_check_fails_keeps_the_plain_path():
    "`unregister_post` withdraws a post function's variants (what `fast_path` does when `hc_variants_check` fails)."
    from dspark.kernels.hc import hc_head_fused, hc_post_fused, hc_post_fused_into, hc_post_head_fused, hc_variants_check
    from dspark.model import mhc
    assert hc_variants_check(DEV, torch.float32) is None   # (on a GPU, the compiled kernels; else the interpreter)
    with torch.no_grad():
        assert mhc.stream_ops(hc_post_fused, hc_head_fused).post_head is hc_post_head_fused
        mhc.unregister_post(hc_post_fused)
        try: assert mhc.stream_ops(hc_post_fused, hc_head_fused) == mhc.StreamOps()
        finally: mhc.register_post(hc_post_fused, hc_post_fused_into, hc_post_head_fused, hc_head_fused)
