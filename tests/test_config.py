"""config.json parsing: official and transformers names, presets, and errors that name the field."""
import json

import pytest
import torch

import dspark
from dspark.config import ConfigError, from_dict, preset, to_dict, PRESETS


def test_presets_round_trip():
    for name in PRESETS:
        c = preset(name)
        assert from_dict(json.loads(json.dumps(to_dict(c)))) == c


def test_transformers_names_are_understood():
    d = to_dict(preset("tiny"))
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling"): d.pop(k)
    d["mlp_layer_types"] = ["hash_moe"] * 3 + ["moe"] * 3
    d["partial_rotary_factor"] = 0.5
    d["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 10000.0},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4,
                                         "original_max_position_embeddings": 256}}
    c = from_dict(d)
    t = preset("tiny")
    assert c.compress_ratios[:6] == t.compress_ratios[:6] and c.num_hash_layers == 3 and c.qk_rope_head_dim == 64
    assert c.rope_scaling["factor"] == 4


@pytest.mark.parametrize("change,field", [
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"head_dim": 100}, "head_dim"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ({"compress_ratios": [0, 0, 4]}, "compress_ratios"),
    ({"index_head_dim": 96}, "index_head_dim"),
    ({"model_type": "llama"}, "model_type"),
    ({"index_top_k": 5}, "index_top_k"),
    ({"expert_dtype": "int3"}, "expert_dtype"),
    ({"dspark_target_layer_ids": [5, 2]}, "dspark_target_layer_ids"),
])
def test_bad_field_is_named(change, field):
    with pytest.raises(ConfigError, match=field):
        from_dict({**PRESETS["tiny"], **change})


def test_missing_fields_are_listed():
    d = dict(PRESETS["tiny"]); d.pop("hidden_size"); d.pop("vocab_size")
    with pytest.raises(ConfigError, match="hidden_size") as e:
        from_dict(d)
    assert "vocab_size" in str(e.value)


def test_bad_config_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="JSON"):
        dspark.load_config(tmp_path)


def test_token_ids_outside_vocab(tiny_model):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_model.logits(torch.tensor([[1, 2, 512]]))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny_model.logits(torch.tensor([[-1, 2]]))
    with pytest.raises(TypeError, match="integer"):
        tiny_model.logits(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="shape"):
        tiny_model.logits(torch.tensor([1, 2]))
