"""The server's command line as generated from the settings dataclasses: `--speculative-config` (vLLM's JSON form)
against the short flags, the environment, and the errors a wrong setting gets."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from dspark.engine.args import EngineArgs
from dspark.entrypoints.llm import LLM
from dspark.entrypoints.serve import parse_args, resolve
from serving import ROOT

SHORT = ["--speculative", "dspark", "--num-speculative-tokens", "3", "--fp8-draft-head", "--capacity", "threshold",
         "--capacity-threshold", "0.25", "--capacity-activation", "2", "--no-dynamic-draft-depth", "--no-online-sts",
         "--plain-switch"]
JSON = {"method": "dspark", "num_speculative_tokens": 3, "fp8_draft_head": True, "capacity": "threshold",
        "capacity_threshold": 0.25, "capacity_activation": 2, "dynamic_draft_depth": False, "online_sts": False,
        "plain_switch": True}


def error(argv, env=None, capsys=None) -> str:
    "The message `parse_args` exits with."
    with pytest.raises(SystemExit) as e: parse_args(["--device", "cpu", *argv], env={} if env is None else env)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_json_form_equals_the_short_forms():
    short = parse_args(["--device", "cpu", *SHORT], env={})
    assert parse_args(["--device", "cpu", "--speculative-config", json.dumps(JSON)], env={}) == short
    assert parse_args(["--device", "cpu"], env={"DSPARK_SPECULATIVE_CONFIG": json.dumps(JSON)}) == short
    half = {k: JSON[k] for k in ("num_speculative_tokens", "capacity", "plain_switch")}      # the same keys in both agree
    assert parse_args(["--device", "cpu", *SHORT, "--speculative-config", json.dumps(half)], env={}) == short
    assert short.speculative_config("dspark", 3) == JSON | {"capacity_sps": "auto"}        # the dry run's object


def test_command_line_wins_over_environment():
    env = {"DSPARK_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 5}', "DSPARK_CAPACITY": "lagged"}
    a = parse_args(["--device", "cpu", "--num-speculative-tokens", "2", "--speculative-config", '{"capacity": "off"}'], env=env)
    assert a.num_speculative_tokens == 2 and a.capacity == "off"
    a = parse_args(["--device", "cpu"], env=env | {"DSPARK_MAX_NUM_SEQS": "3", "DSPARK_ONLINE_STS": "no"})
    assert a.num_speculative_tokens == 5 and a.capacity == "lagged" and a.max_num_seqs == 3 and not a.online_sts


def test_speculative_config_errors(capsys):
    msg = lambda argv, env=None: error(argv, env, capsys)
    assert "unknown key 'num_spec_tokens'" in msg(["--speculative-config", '{"num_spec_tokens": 3}'])
    assert "--speculative-config is not valid JSON" in msg(["--speculative-config", "{method: dspark}"])
    assert "must be a JSON object" in msg(["--speculative-config", "[3]"])
    assert "DSPARK_SPECULATIVE_CONFIG is not valid JSON" in msg([], {"DSPARK_SPECULATIVE_CONFIG": "{"})
    assert "'num_speculative_tokens' must be int or null, got \"3\"" in msg(["--speculative-config", '{"num_speculative_tokens": "3"}'])
    assert "'method' must be one of" in msg(["--speculative-config", '{"method": "eagle"}'])
    m = msg(["--num-speculative-tokens", "3", "--speculative-config", '{"num_speculative_tokens": 4}'])
    assert "--num-speculative-tokens 3 conflicts with \"num_speculative_tokens\": 4 in --speculative-config" in m
    m = msg(["--speculative", "mtp", "--speculative-config", '{"method": "dspark"}'])
    assert "--speculative mtp conflicts with \"method\": \"dspark\"" in m
    m = msg([], {"DSPARK_PLAIN_SWITCH": "1", "DSPARK_SPECULATIVE_CONFIG": '{"plain_switch": false}'})
    assert "DSPARK_PLAIN_SWITCH=1 conflicts with \"plain_switch\": false in DSPARK_SPECULATIVE_CONFIG" in m
    assert "threshold" in msg(["--speculative-config", '{"capacity": "threshold", "capacity_threshold": 2}'])


def test_flag_errors_and_defaults_as_before(capsys):
    msg = lambda argv, env=None: error(argv, env, capsys)
    assert "--max-num-seqs must be positive, got 0" in msg(["--max-num-seqs", "0"])
    assert "--port must be positive, got -1" in msg([], {"DSPARK_PORT": "-1"})
    assert "--gpu-memory-utilization must be in (0, 1], got 1.5" in msg(["--gpu-memory-utilization", "1.5"])
    assert "argument --max-num-seqs: invalid int value: 'many'" in msg([], {"DSPARK_MAX_NUM_SEQS": "many"})
    assert "DSPARK_ONLINE_STS='maybe' is not a boolean" in msg([], {"DSPARK_ONLINE_STS": "maybe"})
    assert "invalid choice" in msg([], {"DSPARK_KV_CACHE_DTYPE": "int8"})        # the environment is checked as flags are
    a = parse_args(["--device", "cpu"], env={})
    assert (a.host, a.port, a.max_num_seqs, a.max_num_batched_tokens, a.gpu_memory_utilization, a.dtype) == (
        "127.0.0.1", 8000, 16, 2048, 0.9, "float32")
    assert a.speculative == "auto" and a.capacity == "off" and a.enable_prefix_caching and not a.enforce_eager
    assert a.served_model_name == "default"


def test_llm_kwargs_are_llm_arguments(tiny_ckpt):
    a = EngineArgs(model=str(tiny_ckpt), device="cpu", speculative="auto", capacity="lagged")
    kw = a.llm_kwargs()
    assert set(kw) <= set(inspect.signature(LLM.__init__).parameters)
    assert kw["speculative"] == "dspark" and kw["capacity"].policy == "lagged" and kw["max_num_batched_tokens"] == 2048
    assert resolve(parse_args(["--model", str(tiny_ckpt), "--device", "cpu", "--speculative", "none"], env={}))[0]["speculative"] == "none"


def test_dry_run_prints_the_resolved_speculative_config(tiny_ckpt):
    env = {"PATH": "", "OMP_NUM_THREADS": "1", "DSPARK_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 2, "capacity": "lagged"}'}
    r = subprocess.run([sys.executable, "-m", "dspark.serve", "--model", str(tiny_ckpt), "--device", "cpu", "--dry-run"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("speculative config: "))
    spec = json.loads(line[len("speculative config: "):])
    assert spec["method"] == "dspark" and spec["num_speculative_tokens"] == 2 and spec["capacity"] == "lagged"
