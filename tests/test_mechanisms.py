"""Each V4 mechanism matters (switching it off changes the logits), and the model is causal."""
import copy
from dataclasses import replace

import pytest
import torch

import dspark.model.transformer
from dspark.config import CSA, HCA, SLIDING

T = 150  # longer than the window (64), several HCA entries (ratio 16), more CSA entries (37) than top-k (16)


def _with_cfg(model, **changes):
    m = copy.deepcopy(model)
    cfg = replace(m.cfg, **changes)
    for mod in m.modules():
        if hasattr(mod, "cfg"): mod.cfg = cfg
    return m


def _drop_kind(model, kind):
    m = copy.deepcopy(model)
    hit = [blk for blk in m.layers if blk.attn.kind == kind]
    assert hit, f"the tiny preset has no {kind} layer"
    for blk in hit: blk.attn.kind = SLIDING
    return m


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (2, T), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def base(tiny_model, ids):
    return tiny_model.logits(ids)


def _changed(a, b):
    return (a - b).abs().max().item() > 1e-3 * a.abs().max().item()


def test_window_matters(tiny_model, ids, base):
    assert _changed(base, _with_cfg(tiny_model, sliding_window=10**6).logits(ids))
    # ...and only beyond the window: the first 64 positions see the same keys either way
    wide = _with_cfg(tiny_model, sliding_window=10**6).logits(ids)
    torch.testing.assert_close(wide[:, :64], base[:, :64], rtol=1e-5, atol=1e-5)


def test_csa_matters(tiny_model, ids, base):
    assert _changed(base, _drop_kind(tiny_model, CSA).logits(ids))


def test_hca_matters(tiny_model, ids, base):
    assert _changed(base, _drop_kind(tiny_model, HCA).logits(ids))


def test_indexer_topk_matters(tiny_model, ids, base):
    everything = _with_cfg(tiny_model, index_topk=10**4).logits(ids)
    assert _changed(base, everything)
    # queries with at most 16 visible CSA entries (p < 68) select all of them either way
    torch.testing.assert_close(everything[:, :67], base[:, :67], rtol=1e-5, atol=1e-5)


def test_hash_routing_matters(tiny_model, ids, base):
    m = copy.deepcopy(tiny_model)
    for blk in m.layers[: m.cfg.num_hash_layers]:
        g = blk.ffn.gate
        g.hashed, g.bias = False, torch.nn.Parameter(torch.zeros(m.cfg.n_routed_experts))
    assert _changed(base, m.logits(ids))


def test_mhc_matters(tiny_model, ids, base, monkeypatch):
    hc = tiny_model.cfg.hc_mult

    def plain_pre(x, fn, b, s, cfg):  # uniform collapse, unit post, identity mixing: a plain residual per stream
        return x.mean(-2), x.new_ones(*x.shape[:-2], hc), torch.eye(hc).expand(*x.shape[:-2], hc, hc)

    monkeypatch.setattr(dspark.model.transformer, "hc_pre", plain_pre)
    assert _changed(base, tiny_model.logits(ids))


def test_sinks_matter(tiny_model, ids, base):
    m = copy.deepcopy(tiny_model)
    for blk in m.layers: blk.attn.attn_sink.data.fill_(-1e4)
    assert _changed(base, m.logits(ids))


@pytest.mark.parametrize("t", [3, 15, 16, 63, 64, 100, 149])
def test_causal(tiny_model, ids, base, t):
    "Changing token t never changes the logits of earlier positions (window, compressors, indexer)."
    ids2 = ids.clone()
    ids2[:, t] = (ids2[:, t] + 1) % 512
    out = tiny_model.logits(ids2)
    torch.testing.assert_close(out[:, :t], base[:, :t], rtol=1e-5, atol=1e-5)
    assert _changed(base[:, t:], out[:, t:])


def test_batch_rows_are_independent(tiny_model, ids, base):
    torch.testing.assert_close(tiny_model.logits(ids[1:]), base[1:], rtol=1e-5, atol=1e-5)
