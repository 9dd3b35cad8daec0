"""The reference target against transformers' DeepseekV4ForCausalLM, our independent oracle."""
import pytest
import torch

import dspark

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tiny_ckpt):
    return transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


@pytest.mark.parametrize("seq_len", [1, 7, 63, 150, 301])
def test_logits_match_transformers(tiny_model, hf_model, seq_len):
    ids = torch.randint(0, tiny_model.cfg.vocab_size, (2, seq_len))
    ours = tiny_model.logits(ids)
    with torch.no_grad():
        theirs = hf_model(ids).logits.float()
    assert ours.shape == theirs.shape == (2, seq_len, tiny_model.cfg.vocab_size)
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err <= 1e-4, f"max |Δ| / max |logits| = {err:.2e} at T={seq_len}"


def test_other_seeds_match_transformers(tmp_path):
    "A second random checkpoint (different seed) agrees too: parity is not an accident of one draw."
    ck = dspark.make_tiny_checkpoint(tmp_path / "s7", seed=7, drafter=None)
    ours = dspark.load_target(ck)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (2, 211))
    with torch.no_grad():
        theirs = hf(ids).logits.float()
    assert (ours.logits(ids) - theirs).abs().max() <= 1e-4 * theirs.abs().max()


def test_checkpoint_is_non_trivial(tiny_ckpt):
    "The parity checkpoint exercises every parameter: no zero sinks, biases, position biases or mHC params."
    from dspark.model.checkpoint import read_tensors
    raw = read_tensors(tiny_ckpt)
    for k, t in raw.items():
        if t.is_floating_point():
            assert t.numel() == 1 or t.float().std() > 0, f"{k} is constant"
            assert (t != 0).float().mean() > 0.9, f"{k} is mostly zero"
        if k.endswith(("norm.weight",)):
            assert (t - 1).abs().max() > 0.05, f"{k} is an identity norm"
