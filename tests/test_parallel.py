"""Tensor parallelism on CPU/gloo: TP=2 reproduces TP=1 (tokens for none/mtp/dspark, logits within 1e-5; also with
weights kept as stored and with dummy weights), rank 0's decisions win over a perturbed rank, debug mode names a divergence instead of hanging, an env:// (torchrun-style)
launch of two processes works, bad sizes are refused before any worker starts, and workers do not outlive the LLM."""
import gc
import json
import multiprocessing
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import dspark
from dspark.distributed.sharding import RankCanon, TPDivergence
from dspark.sample.sampling import SamplingParams
from dspark.distributed.tp import TPError
from dspark.model.layers import Gate, score_fn

KV = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
SP = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(20, 60))]          # short, and past the CSA (4) and HCA (16) windows


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _ref(ck):
    "TP=1 greedy tokens without drafts (speculative greedy decoding is token-identical to it: test_speculative.py)."
    return _ids(dspark.LLM(ck, **KV).generate(PROMPTS, SP, use_tqdm=False))


@pytest.fixture(scope="module")
def ckd(tiny_ckpt):
    return tiny_ckpt                                           # conftest's: tiny, fp32, DSpark drafter


@pytest.fixture(scope="module")
def ref_none(ckd):
    return _ref(ckd)


def _perturb_logits(llm):
    "On rank 1 only: noisy target logits, so rank 1 samples and accepts different tokens than rank 0 would."
    if llm.rank != 1 or getattr(llm.runner, "perturbed", False): return
    forward = llm.runner.forward
    llm.runner.forward = lambda *a, **k: [lg + 10 * torch.randn_like(lg) for lg in forward(*a, **k)]
    llm.runner.perturbed = True


@pytest.fixture(scope="module")
def tp_dspark(ckd):
    """One TP=2 DSpark engine for the module (spawning is slow), with rank 1's logits perturbed from the start, and
    capacity control on from 2 requests (its SPS curve and each step's capacity vector are rank 0's too)."""
    from dspark.spec.controller import CapacityConfig
    cap = CapacityConfig(sps=[(t, 100.0 - t) for t in (1, 2, 4, 8, 16)], activation=2)   # verifying is nearly free
    llm = dspark.LLM(ckd, speculative="dspark", num_speculative_tokens=2, tensor_parallel_size=2, capacity=cap, **KV)
    llm.run_on_ranks(_perturb_logits)
    yield llm
    llm.close()


def _stall_rank1(llm, seconds):
    "Rank 1 stops answering for a while, then both ranks run a forward (whose all-reduces rank 0 waits on)."
    if llm.rank == 1: time.sleep(seconds)
    llm.model.logits(torch.tensor([[1, 2, 3]]))


def test_bad_sizes_are_refused_before_workers_start(ckd):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads=8, o_groups=4"):
        dspark.LLM(ckd, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="positive integer"):
        dspark.LLM(ckd, tensor_parallel_size=0)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs 2 GPUs"):
            dspark.LLM(ckd, tensor_parallel_size=2, device="cuda")
    assert multiprocessing.active_children() == []


def test_dspark_tp2_greedy_identical_despite_a_perturbed_rank(ref_none, tp_dspark):
    "Rank 1 samples from noisy logits, yet the tokens are TP=1's: every rank applies rank 0's decisions."
    assert _ids(tp_dspark.generate(PROMPTS, SP, use_tqdm=False)) == ref_none
    assert tp_dspark.spec_stats()["num_drafts"] > 0 and tp_dspark.runner.capacity.stats.active_steps > 0


def _routing_margins(model) -> list[torch.Tensor]:
    """Forward hooks on every score-routed `Gate`: per call, each position's gap between the k-th and (k+1)-th
    bias-corrected score. A gap near float rounding is a near-tie that a TP partial sum may break the other way."""
    margins, hooks = [], []
    def hook(gate, inputs, _):
        s = score_fn(F.linear(inputs[0].float(), gate.weight.float()), gate.cfg.scoring_func) + gate.bias.float()
        top = s.topk(gate.cfg.num_experts_per_tok + 1, dim=-1).values
        margins.append((top[..., -2] - top[..., -1]).reshape(-1))
    for m in model.modules():
        if isinstance(m, Gate) and not m.hashed: hooks.append(m.register_forward_hook(hook))
    return margins, hooks


def test_tp2_logits_match_unsharded(ckd, tp_dspark):
    """TP=2 logits equal the unsharded model's within 1e-5 at every position whose routing is not a near-tie: where
    the k-th and (k+1)-th expert scores are within ~1e-6, the sharded sum (another summation order) may pick the
    other expert, a legitimate and large difference. Nearly every position must still be compared."""
    ids = torch.tensor([PROMPTS[1]])
    model = dspark.load_target(ckd)
    margins, hooks = _routing_margins(model)
    ref = model.logits(ids)
    for h in hooks: h.remove()
    T = ids.shape[1]
    assert margins and all(m.numel() == T for m in margins)   # one call per routed layer, one row per position
    clear = torch.stack(margins).min(0).values > 1e-5         # positions with no near-tie in any layer
    assert clear.sum().item() >= T - 2, f"only {clear.sum().item()} of {T} positions are free of routing near-ties"
    tp = tp_dspark.logits(ids)
    assert tp.shape == ref.shape and (tp - ref)[:, clear].abs().max().item() < 1e-5


def test_a_second_tp_engine_is_refused_while_one_is_open(ckd, tp_dspark):
    "A second TP engine would hang in `dist.new_group` (the first one's workers never join it): it is refused."
    before = set(multiprocessing.active_children())
    with pytest.raises(TPError, match=r"another tensor-parallel engine is still open in this process; close\(\) it first"):
        dspark.LLM(ckd, tensor_parallel_size=2, **KV)
    assert set(multiprocessing.active_children()) == before  # no worker was started for it
    assert _ids(tp_dspark.generate(PROMPTS[:1], SP, use_tqdm=False))   # and the open one still works


def test_debug_mode_names_the_divergence(tp_dspark):        # last use of the module's TP LLM: it breaks the group
    tp_dspark.set_tp_debug(True)                              # no broadcast: each rank keeps its own decisions
    with pytest.raises(TPDivergence, match=r"step \d+: accepted tokens of request '\d+' differ across ranks: rank 0: .*; rank 1: "):
        tp_dspark.generate(PROMPTS, SP, use_tqdm=False)
    with pytest.raises(TPError, match="unusable"):
        tp_dspark.generate(PROMPTS, SP, use_tqdm=False)
    procs = tp_dspark._group.procs
    tp_dspark.close()
    assert procs and not any(p.is_alive() for p in procs)


def test_mtp_tp2_greedy_identical_time_out_and_no_orphans(tmp_path):
    ck = dspark.make_tiny_checkpoint(tmp_path, preset="tiny", seed=3, drafter="mtp")
    llm = dspark.LLM(ck, speculative="mtp", num_speculative_tokens=2, tensor_parallel_size=2, tp_timeout=20, **KV)
    assert _ids(llm.generate(PROMPTS, SP, use_tqdm=False)) == _ref(ck)
    assert llm.spec_stats()["num_drafts"] > 0
    with pytest.raises(TPError, match="did not complete within 20 s"):   # a stuck rank: an error, not a hang
        llm.run_on_ranks(_stall_rank1, 40)
    procs = llm._group.procs
    del llm; gc.collect()                                     # garbage collection stops the workers
    assert not any(p.is_alive() for p in procs)


def test_env_rendezvous_two_processes(ckd, ref_none):
    "What torchrun does: two processes, RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, rendezvous over env://."
    with socket.socket() as s:                                # a free port (torchrun would pick --master-port)
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    root = Path(dspark.__file__).parents[1]
    cmd = [sys.executable, "-m", "dspark.distributed.tp", "--model", str(ckd), "--tensor-parallel-size", "2",
           "--prompt-ids", json.dumps(PROMPTS), "--max-tokens", str(SP.max_tokens), "--ignore-eos"]
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try: outs = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None: p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    got = json.loads(outs[0][0].strip().splitlines()[-1])
    assert [g["token_ids"] for g in got] == ref_none
    assert outs[1][0].strip() == ""                           # only rank 0 reports


class _WrongStops(RankCanon):
    "Rank 1's stop decisions, falsified: every request stops at its first tokens."
    def __call__(self, decision, what: str = "decision"):
        if what == "stop decisions": decision = {rid: "stop" for rid in decision}
        return super().__call__(decision, what)


def _falsify_stops(llm):
    if llm.rank == 1: llm.runner.canon.__class__ = _WrongStops


def test_a_stop_decision_that_differs_stops_the_group(ckd, capfd):
    """Stop decisions cost no collective (each rank derives them from rank 0's tokens); rank 0's ride in the next
    step message and rank 1 checks its own against them: a difference stops the group, named, instead of a hang."""
    llm = dspark.LLM(ckd, tensor_parallel_size=2, tp_timeout=20, **KV)
    llm.run_on_ranks(_falsify_stops)
    with pytest.raises(TPError):
        llm.generate(PROMPTS, SP, use_tqdm=False)
    procs = llm._group.procs
    llm.close()
    assert not any(p.is_alive() for p in procs)
    assert re.search(r"rank 1 stops: TPDivergence: step 1: stop decisions differ across ranks: rank 0: \{'\d+': None",
                     capfd.readouterr().err)


def _to_fp32(core):
    "On every rank: the plain (bf16) tensors of an as-stored target in fp32, so that logits compare at fp32 rounding."
    _fp32(core.model)


def _fp32(model):
    from dspark.model.weights import StoredLinear
    for m in model.modules():
        if isinstance(m, StoredLinear): continue
        for k, p in list(m.named_parameters(recurse=False)):
            if p.dtype == torch.bfloat16: setattr(m, k, torch.nn.Parameter(p.detach().float(), requires_grad=False))
    return model


def _clear_logits(model, ids):
    "Logits of `model` and the positions free of routing near-ties (see `test_tp2_logits_match_unsharded`)."
    margins, hooks = _routing_margins(model)
    ref = model.logits(ids)
    for h in hooks: h.remove()
    return ref, torch.stack(margins).min(0).values > 1e-5


@pytest.fixture(scope="module")
def fp8_ck(tmp_path_factory):
    return dspark.make_tiny_checkpoint(tmp_path_factory.mktemp("fp8tp"), drafter="mtp", fmt="fp8")


def test_tp2_as_stored_equals_tp1_as_stored(fp8_ck):
    """Kept as stored (FP8 blocks, FP4 experts), TP=2 with its MTP drafter gives TP=1's greedy tokens wherever TP=1's
    top-2 logit gap exceeds bf16 noise, and, with the plain tensors cast to fp32 on both sides, TP=1's logits
    within 1e-5 at every position free of routing near-ties (the stored codes are the same bytes)."""
    kw = dict(quantization="auto", **KV)
    one = dspark.LLM(fp8_ck, **kw)
    ref = _ids(one.generate(PROMPTS, SP, use_tqdm=False))
    model = one.engine.model
    one.close()
    llm = dspark.LLM(fp8_ck, tensor_parallel_size=2, speculative="mtp", num_speculative_tokens=2, **kw)
    got = _ids(llm.generate(PROMPTS, SP, use_tqdm=False))
    for p, r, g in zip(PROMPTS, ref, got):
        lg = model.logits(torch.tensor([p + r]))[0, len(p) - 1:-1].float()
        top = lg.topk(2, -1).values
        safe = next((i for i, m in enumerate((top[:, 0] - top[:, 1]).tolist()) if m < 0.25), len(r))
        assert g[:safe] == r[:safe], (p, r, g, safe)
    ids = torch.tensor([PROMPTS[1]])
    want, clear = _clear_logits(_fp32(model), ids)
    llm.run_on_ranks(_to_fp32)
    tp = llm.logits(ids)
    llm.close()
    assert clear.sum().item() >= ids.shape[1] - 2
    assert tp.dtype == torch.float32 and (tp - want)[:, clear].abs().max().item() < 1e-5


def test_tp2_dummy_weights_are_tp1s_sliced(fp8_ck, tmp_path):
    """`load_format="dummy"` under TP=2, from a directory holding only `config.json`: each rank makes its slices of the
    weights TP=1 makes from the same seed (replicated tensors agree across ranks), so it generates, and its logits
    equal the unsharded dummy model's (fp32 plain tensors) within 1e-5."""
    from dspark.model.checkpoint import load_config, meta_target
    from dspark.model.weights import dummy_weights
    (tmp_path / "config.json").write_text((fp8_ck / "config.json").read_text())
    llm = dspark.LLM(tmp_path, tensor_parallel_size=2, quantization="auto", load_format="dummy", seed=7,
                     speculative="mtp", num_speculative_tokens=2, **KV)
    out = _ids(llm.generate(PROMPTS, SP, use_tqdm=False))
    assert [len(t) for t in out] == [SP.max_tokens] * 2
    ids = torch.tensor([PROMPTS[1]])
    want, clear = _clear_logits(_fp32(dummy_weights(meta_target(load_config(tmp_path), quantization="auto"), seed=7)), ids)
    llm.run_on_ranks(_to_fp32)
    tp = llm.logits(ids)
    llm.close()
    assert clear.sum().item() >= ids.shape[1] - 2
    assert (tp - want)[:, clear].abs().max().item() < 1e-5
