"""Official-layout checkpoints: release formats, and damaged checkpoints refused with the damage named."""
import json

import pytest
import torch

import dspark
from dspark.model.checkpoint import CheckpointError, dequantize_state, quantize_checkpoint, read_tensors, save_checkpoint
from dspark.model.quant import e8m0_to_float


def test_layout(tiny_ckpt):
    names = {p.name for p in tiny_ckpt.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json"} <= names
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    keys = set(index["weight_map"])
    assert "embed.weight" in keys and "head.weight" in keys and "hc_head_fn" in keys
    assert not any(k.startswith("model.") for k in keys)
    assert "layers.0.ffn.gate.tid2eid" in keys and "layers.3.ffn.gate.bias" in keys
    assert "layers.2.attn.indexer.compressor.ape" in keys and "mtp.0.main_proj.weight" in keys


def test_fp8_fp4_variant_matches_within_format_error(tiny_ckpt, tiny_model, tmp_path):
    q = quantize_checkpoint(tiny_ckpt, tmp_path / "fp8")
    stored = read_tensors(q)
    assert stored["layers.0.attn.wq_b.weight"].dtype == torch.float8_e4m3fn
    assert stored["layers.0.attn.wq_b.scale"].dtype == torch.float8_e8m0fnu
    assert stored["layers.4.ffn.experts.3.w1.weight"].dtype == torch.int8          # packed FP4
    assert stored["layers.4.ffn.experts.3.w1.weight"].shape[1] * 2 == tiny_model.cfg.hidden_size
    assert json.loads((q / "config.json").read_text())["expert_dtype"] == "fp4"
    orig, deq = dequantize_state(read_tensors(tiny_ckpt)), dequantize_state(stored)
    for k, w in orig.items():
        got = deq[k]
        if not w.is_floating_point():
            assert torch.equal(got, w); continue
        s = stored.get(k.removesuffix(".weight") + ".scale")
        if stored[k].dtype == torch.float8_e4m3fn:          # e4m3: relative 2^-4 (+ subnormal floor)
            floor = e8m0_to_float(s).repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]] * 2**-9
            assert ((got - w).abs() <= w.abs() * 2**-4 + floor).all(), k
        elif stored[k].dtype == torch.int8:                  # e2m1: within one block scale
            assert ((got - w).abs() <= e8m0_to_float(s).repeat_interleave(32, -1)).all(), k
        elif stored[k].dtype == torch.bfloat16:
            assert ((got - w).abs() <= w.abs() * 2**-8).all(), k
        else:
            assert torch.equal(got, w), k
    m8 = dspark.load_target(q)
    ids = torch.randint(0, 512, (1, 90))
    a, b = tiny_model.logits(ids), m8.logits(ids)
    # FP4 on random (not quantisation-aware) weights is coarse, but the model is the same model
    assert torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.9


def test_bf16_load_keeps_fp32_where_the_official_code_does(tiny_ckpt):
    m = dspark.load_target(tiny_ckpt, dtype="bfloat16")
    assert m.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert m.layers[0].hc_attn_fn.dtype == torch.float32 and m.layers[0].attn.attn_sink.dtype == torch.float32
    assert m.logits(torch.tensor([[1, 2, 3]])).dtype == torch.float32


def _damage(tiny_ckpt, tmp_path, fn):
    raw = read_tensors(tiny_ckpt)
    fn(raw)
    cfg = dspark.load_config(tiny_ckpt)
    return save_checkpoint(raw, cfg, tmp_path / "bad")


@pytest.mark.parametrize("damage,expect", [
    (lambda r: r.pop("layers.3.attn.compressor.ape"), "missing"),
    (lambda r: r.__setitem__("layers.9.attn.wq_a.weight", torch.zeros(2, 2)), "unexpected"),
    (lambda r: r.__setitem__("layers.0.attn.wq_a.weight", r["layers.0.attn.wq_a.weight"][:, :10]), "mis-shaped"),
    (lambda r: r.__setitem__("norm.weight", r["norm.weight"] * float("nan")), "non-finite"),
])
def test_damaged_checkpoint_is_refused(tiny_ckpt, tmp_path, damage, expect):
    bad = _damage(tiny_ckpt, tmp_path, damage)
    with pytest.raises(CheckpointError, match=expect):
        dspark.load_target(bad)


def test_error_lists_every_missing_tensor(tiny_ckpt, tmp_path):
    def drop(r):
        for k in ["layers.1.attn.wkv.weight", "layers.2.attn.indexer.weights_proj.weight"]: r.pop(k)
    with pytest.raises(CheckpointError) as e:
        dspark.load_target(_damage(tiny_ckpt, tmp_path, drop))
    assert "layers.1.attn.wkv.weight" in str(e.value) and "layers.2.attn.indexer.weights_proj.weight" in str(e.value)


def test_missing_shard_and_empty_dir(tiny_ckpt, tmp_path):
    import shutil
    d = tmp_path / "ck"; shutil.copytree(tiny_ckpt, d)
    next(d.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        dspark.load_target(d)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        dspark.load_target(tmp_path / "empty")


def test_bad_tid2eid_is_refused(tiny_ckpt, tmp_path):
    bad = _damage(tiny_ckpt, tmp_path, lambda r: r["layers.0.ffn.gate.tid2eid"].__setitem__((0, 0), 99))
    with pytest.raises(CheckpointError, match="tid2eid"):
        dspark.load_target(bad)


def test_unsupported_dtype(tiny_ckpt):
    with pytest.raises(ValueError, match="dtype"):
        dspark.load_target(tiny_ckpt, dtype="int8")
