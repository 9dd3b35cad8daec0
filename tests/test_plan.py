"""The memory plan of the shipped V4-Flash configs (`dspark.distributed.plan`, `--dry-run`) against stored bytes
computed here, independently, from the meta model's shapes and the release checkpoint's formats; `--hf-overrides`;
the engine's start-up profile line."""
from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
import torch

from dspark.config import ConfigError, load_config, named_configs, parse_overrides, resolve_model
from dspark.distributed.plan import GB, plan_memory
from dspark.entrypoints.llm import LLM
from dspark.sample.sampling import SamplingParams
from dspark.entrypoints.serve import main, parse_args
from dspark.model.checkpoint import CheckpointError, draft_shapes
from dspark.model.transformer import Transformer
from serving import ROOT

FLASH_INDEX_TOTAL = 159_609_485_896      # metadata.total_size of V4-Flash's model.safetensors.index.json (reference §4)
SERVE = dict(utilization=0.975, max_model_len=524_288, max_num_seqs=16, max_num_batched_tokens=2048)


def stored(name: str, shape: tuple[int, ...]) -> int:
    "Bytes of one tensor in the release format, written out here from reference §4 (not the plan module's code)."
    n = math.prod(shape)
    if re.search(r"\.experts\.\d+\.w[123]\.weight$", name):                      # FP4 e2m1, one E8M0 per 32 inputs
        return n // 2 + shape[0] * -(-shape[1] // 32)
    fp8 = ("attn.wq_a.", "attn.wq_b.", "attn.wkv.", "attn.wo_a.", "attn.wo_b.", "indexer.wq_b.", "shared_experts.w",
           "e_proj.", "h_proj.", "main_proj.")
    if name.endswith(".weight") and any(f in name for f in fp8):                  # FP8 e4m3, E8M0 per 128x128
        return n + -(-shape[0] // 128) * -(-shape[1] // 128)
    if name.endswith("tid2eid"): return 8 * n
    leaf = name.rsplit(".", 1)[-1]
    if leaf.startswith("hc_") or leaf in ("attn_sink", "ape") or name.endswith("gate.bias"): return 4 * n
    return 2 * n


def split_over_ranks(name: str) -> bool:
    "Tensors that tensor parallelism splits (heads, groups, experts, shared-expert slices, vocabulary)."
    return bool(re.search(r"^(embed|head)\.weight$|\.attn\.(wq_b|wo_a|wo_b)\.weight$|\.attn\.attn_sink$|"
                          r"\.indexer\.(wq_b|weights_proj)\.weight$|\.ffn\.(experts|shared_experts)\.", name))


@pytest.fixture(scope="module")
def models():
    "name -> (config, drafter the server picks, {tensor: shape} of the meta target and its mtp.* tensors)."
    flash, c731 = (load_config(named_configs()[n]) for n in ("deepseek-v4-flash", "deepseek-v4-flash-0731"))
    with torch.device("meta"): target = {k: tuple(v.shape) for k, v in Transformer(flash).state_dict().items()}
    assert flash.compress_ratios[:43] == c731.compress_ratios[:43]       # one backbone: 0731 adds DSpark stages
    return {"deepseek-v4-flash": (flash, "mtp", target | draft_shapes(flash, "mtp")),
            "deepseek-v4-flash-0731": (c731, "dspark", target | draft_shapes(c731, "dspark"))}


def test_named_configs_are_v4_flash(models):
    cfg, _, shapes = models["deepseek-v4-flash"]
    assert (cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.vocab_size, cfg.hidden_size) == \
        (43, 256, 6, 129280, 4096)
    target = sum(math.prod(s) for k, s in shapes.items() if not k.startswith("mtp."))
    assert 283e9 < target < 285.5e9                                           # the official ~284B
    assert sum(stored(k, s) for k, s in shapes.items()) == FLASH_INDEX_TOTAL  # this test's formats match the real index
    c731 = models["deepseek-v4-flash-0731"][0]
    assert (c731.num_draft_stages, c731.dspark_block_size, c731.dspark_target_layer_ids) == (3, 5, [40, 41, 42])
    assert resolve_model("deepseek-v4-flash") == named_configs()["deepseek-v4-flash"]


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-flash-0731"])
@pytest.mark.parametrize("tp", [1, 2])
def test_weights_per_rank_are_stored_bytes_over_tp_plus_replicated(models, name, tp):
    cfg, drafter, shapes = models[name]
    mode = "dspark" if drafter == "dspark" else None                       # base Flash serves without its MTP block
    held = {k: s for k, s in shapes.items() if mode or not k.startswith("mtp.")}
    split = sum(stored(k, s) for k, s in held.items() if split_over_ranks(k))
    replicated = sum(stored(k, s) for k, s in held.items() if not split_over_ranks(k))
    p = plan_memory(cfg, tp, 141 * GB, drafter=mode, num_speculative_tokens=5 if mode else 0, **SERVE)
    expect = split / tp + replicated
    assert abs(p.weights - expect) <= 0.02 * expect, (p.weights / 2**30, expect / 2**30)
    if tp == 1: assert p.weights == expect                                  # nothing split: exactly the stored bytes


def test_kv_tokens_grow_with_memory(models):
    cfg = models["deepseek-v4-flash"][0]
    plans = [plan_memory(cfg, 2, gb * GB, **SERVE) for gb in (96, 120, 141, 200)]
    tokens = [p.kv_tokens for p in plans]
    assert tokens[0] > 0 and all(a < b for a, b in zip(tokens, tokens[1:])), tokens
    assert len({p.weights for p in plans}) == 1                             # memory changes the cache, not the weights
    fp8 = plan_memory(cfg, 2, 96 * GB, kv_cache_dtype="fp8", **SERVE)
    assert 1.8 < fp8.kv_tokens / plans[0].kv_tokens < 2.1                   # 3,514 B vs 6,880 B a token
    assert plan_memory(cfg, 1, 96 * GB, **SERVE).kv_tokens == 0             # 145 GiB of weights do not fit one card


def test_cli_dry_run_prints_the_plan_and_overrides_cut_layers(models, capsys):
    args = ["--model", "deepseek-v4-flash-0731", "--tensor-parallel-size", "2", "--gpu-memory-gb", "141",
            "--gpu-memory-utilization", "0.975", "--max-model-len", "524288", "--dry-run", "--device", "cpu"]
    assert main(args) == 0
    full = capsys.readouterr().out
    cut = subprocess.run([sys.executable, "-m", "dspark.serve", *args, "--hf-overrides", '{"num_hidden_layers": 12}'],
                         capture_output=True, text=True, env={"PATH": "", "OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=120)
    assert cut.returncode == 0, cut.stderr
    weights = lambda out: float(re.search(r"memory per rank: weights ([\d.]+) GiB", out).group(1))
    cfg = models["deepseek-v4-flash-0731"][0]
    expect = plan_memory(cfg, 2, 141 * GB, drafter="dspark", num_speculative_tokens=5, **SERVE).weights / 2**30
    assert abs(weights(full) - expect) < 0.01 and "43 layers" in full and "KV cache" in full
    assert "12 layers" in cut.stdout and 0.25 < weights(cut.stdout) / weights(full) < 0.35   # ~ (12+3)/(43+3)
    assert '"speculative": "dspark"' in cut.stdout                         # its drafter still reads the last 3 layers


def test_the_reference_cards_in_gib_give_0731_more_kv_tokens_than_the_seed(models, capsys):
    """The reference deployment's cards hold 96 GiB (`--gpu-memory-gib`, not 96 GB): 0731 with DSpark at TP 2, 0.975,
    524,288 plans more KV tokens than the 1,205,591 it reported. Both units at once is an error."""
    args = ["--model", "deepseek-v4-flash-0731", "--speculative", "dspark", "--tensor-parallel-size", "2",
            "--gpu-memory-utilization", "0.975", "--max-model-len", "524288", "--dry-run", "--device", "cpu"]
    assert main(args + ["--gpu-memory-gib", "96"]) == 0
    out = capsys.readouterr().out
    tokens = int(re.search(r"memory per rank: .* = ([\d,]+) tokens", out).group(1).replace(",", ""))
    cfg = models["deepseek-v4-flash-0731"][0]
    assert tokens == plan_memory(cfg, 2, 96 * 2**30, drafter="dspark", num_speculative_tokens=5, **SERVE).kv_tokens > 1_205_591
    with pytest.raises(SystemExit, match="not both"): main(args + ["--gpu-memory-gib", "96", "--gpu-memory-gb", "96"])


def test_overrides_cut_consistently_and_bad_ones_fail(capsys):
    c = load_config(resolve_model("deepseek-v4-flash-0731"), {"num_hidden_layers": 12})
    assert c.compress_ratios == [0, 0] + [4, 128] * 5 + [0, 0, 0] and c.dspark_target_layer_ids == [9, 10, 11]
    assert load_config(resolve_model("deepseek-v4-flash"), '{"num_hidden_layers": 2}').num_hash_layers == 2
    for bad, msg in (('{"num_hidden_layer": 12}', "num_hidden_layer"), ("{num_hidden_layers: 12}", "not valid JSON"),
                     ("[12]", "JSON object"), ('{"num_hidden_layers": 50}', "compress_ratios")):
        with pytest.raises(ConfigError, match=re.escape(msg)): load_config(resolve_model("deepseek-v4-flash"), bad)
        with pytest.raises(SystemExit): parse_args(["--device", "cpu", "--model", "deepseek-v4-flash", "--hf-overrides", bad], env={})
        assert msg in capsys.readouterr().err
    assert parse_overrides(None) == {}
    env = parse_args(["--device", "cpu", "--model", "deepseek-v4-flash"], env={"DSPARK_HF_OVERRIDES": '{"num_hidden_layers": 4}'})
    assert env.hf_overrides == '{"num_hidden_layers": 4}' and env.model == str(named_configs()["deepseek-v4-flash"])


def test_engine_start_logs_the_profile_line(tiny_ckpt):
    llm = LLM(tiny_ckpt, max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
    line = next(l for l in llm.engine.profile.splitlines() if l.startswith("memory per rank:"))
    model = llm.engine.model
    resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    shown = float(re.search(r"weights ([\d.]+) GiB", line).group(1)) * 2**30
    assert resident <= shown + 0.006 * 2**30 and "estimate" in line and "max concurrency" in line
    with pytest.raises(ValueError, match="hf-overrides"):       # a checkpoint's tensors keep their own shapes
        LLM(tiny_ckpt, hf_overrides={"num_hidden_layers": 2}, kv_cache_memory_bytes=32 * 2**20)


def test_hf_overrides_shape_a_dummy_weight_model(tiny_ckpt):
    llm = LLM(tiny_ckpt, load_format="dummy", hf_overrides={"num_hidden_layers": 1}, kv_cache_memory_bytes=32 * 2**20)
    assert len(llm.engine.model.layers) == 1
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 4


def test_a_directory_with_only_config_json_serves_dummy_weights(tiny_ckpt, tmp_path):
    (tmp_path / "config.json").write_bytes((tiny_ckpt / "config.json").read_bytes())     # no weights, no tokenizer
    with pytest.raises(CheckpointError, match="safetensors"):                         # a real load needs the files
        LLM(tmp_path, kv_cache_memory_bytes=32 * 2**20)
    llm = LLM(tmp_path, load_format="dummy", quantization="auto", kv_cache_memory_bytes=32 * 2**20)
    assert any(type(m).__name__ == "FP8Linear" for m in llm.engine.model.modules())
    out = llm.generate([[0, 5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 3
