"""Simulated acceptance (`EngineCore(simulate_acceptance=a)`, `python -m dspark.bench --simulate-acceptance A`), the
benchmark mode for dummy weights: rounds accept drafts as if the mean acceptance length were `a`, it is off by default,
it refuses what it cannot mean, the server has no way to turn it on, and a benchmark run with it says so."""
import math
from dataclasses import fields

import pytest
import torch

import dspark
from dspark.engine.args import EngineArgs
from dspark.entrypoints.serve import parse_args as serve_args
from dspark.runtime.runner import SimulatedAcceptance, acceptance_probability
from dspark.tools.bench import format_table, parse_args as bench_args, run_bench
from dspark.tools.records import split_raw

K = 5


def moments(a: float, k: int = K) -> tuple[float, float]:
    "Mean and standard deviation of a round's acceptance length (accepted + 1) of `k` drafts under the rule for `a`."
    p = acceptance_probability(a, K)
    pmf = [p ** j * (1 - p) for j in range(k)] + [p ** k]          # j drafts accepted: j successes, then a refusal
    m = sum((j + 1) * w for j, w in enumerate(pmf))
    return m, math.sqrt(sum((j + 1 - m) ** 2 * w for j, w in enumerate(pmf)))


@pytest.mark.parametrize("a", [1.0, 2.0, 3.34, 6.0])
def test_probability_solves_the_mean(a):
    p = acceptance_probability(a, K)
    assert sum(p ** j for j in range(K + 1)) == pytest.approx(a, abs=1e-9)
    assert moments(a)[0] == pytest.approx(a, abs=1e-9)


@pytest.mark.parametrize("a", [1.0, 2.0, 3.34])
def test_rule_mean_within_five_sd(a):
    N, sim = 100_000, SimulatedAcceptance(a, K, seed=3)
    got = 1 + sum(sim.accepted(K) for _ in range(N)) / N
    m, sd = moments(a)
    assert abs(got - a) <= 5 * sd / math.sqrt(N) + 1e-12, (got, a)
    assert sim.accepted(2) <= 2 and sim.accept([7, 8], [1, 2, 3])[1][-1] in (1, 2, 3)


def test_rule_is_deterministic_from_the_seed():
    def draw(seed):
        sim = SimulatedAcceptance(3.34, K, seed)
        return [sim.accepted(K) for _ in range(200)]
    assert draw(0) == draw(0) and draw(0) != draw(1)


def test_refuses_what_it_cannot_mean(tiny_ckpt):
    for a in (0.99, 6.01, -1, True, "3"):
        with pytest.raises(ValueError, match=r"simulate_acceptance must be a mean acceptance length in \[1, K \+ 1\]"):
            SimulatedAcceptance(a, K)
    with pytest.raises(ValueError, match="needs speculative decoding"): SimulatedAcceptance(2.0, 0)
    assert SimulatedAcceptance.of(None, K) is None
    with pytest.raises(ValueError, match=r"\[1, 6\]"):
        dspark.LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=K, device="cpu", simulate_acceptance=6.5)
    with pytest.raises(ValueError, match="needs speculative decoding"):
        dspark.LLM(tiny_ckpt, speculative=None, device="cpu", simulate_acceptance=2.0)


PROMPTS = [[2 + i, 3 + 2 * i, 4, 5 + i] for i in range(16)]


@pytest.mark.parametrize("a,temperature,max_tokens", [(1.0, 0.0, 8), (2.0, 0.0, 48), (3.34, 1.0, 80)])
def test_engine_mean_acceptance_within_five_sd(tiny_ckpt, a, temperature, max_tokens):
    """The engine's rounds (greedy: `greedy_verify`'s place; sampled: after `verify_keyed`) accept by the rule: over
    the rounds that drafted the full depth, the mean acceptance length is within 5 sd of `a`; and what the rule
    drew is exactly what `spec_stats` counts and what the requests committed."""
    llm = dspark.LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=K, device="cpu", max_num_seqs=16,
                     simulate_acceptance=a, kv_cache_memory_bytes=32 * 2**20)
    sim, rounds = llm.runner.simulated, []
    assert llm.runner.round_ahead is None and getattr(llm.runner.forward, "rounds", None) is None
    draw = sim.accepted
    sim.accepted = lambda k: rounds.append((k, draw(k))) or rounds[-1][1]
    sps = [dspark.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(16)]
    outs = llm.generate(PROMPTS, sps, use_tqdm=False)
    st = llm.spec_stats()
    full = [acc for k, acc in rounds if k == K]
    N = len(full)
    m, sd = moments(a)
    got = 1 + sum(full) / N
    assert N >= (16 if a == 1.0 else 200) and abs(got - a) <= 5 * sd / math.sqrt(N) + 1e-12, (got, a, N)
    assert st["simulated"] == a
    assert st["num_accepted_tokens"] == sum(acc for _, acc in rounds)
    assert st["num_drafts"] == sum(k > 0 for k, _ in rounds)
    assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs)


def test_off_by_default(tiny_ckpt):
    """Without the option nothing is simulated: random tiny weights accept few drafts, and greedy speculative decoding
    commits exactly what plain decoding does."""
    sp = dspark.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    spec = dspark.LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=K, device="cpu",
                      kv_cache_memory_bytes=32 * 2**20)
    assert spec.runner.simulated is None
    got = spec.generate(PROMPTS[:4], sp, use_tqdm=False)
    st = spec.spec_stats()
    assert "simulated" not in st and st["num_drafts"] > 0 and st["mean_acceptance_length"] < 2
    plain = dspark.LLM(tiny_ckpt, speculative=None, device="cpu", kv_cache_memory_bytes=32 * 2**20)
    ref = plain.generate(PROMPTS[:4], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]


def test_server_cannot_turn_it_on(tiny_ckpt):
    assert "simulate_acceptance" not in {f.name for f in fields(EngineArgs)}
    with pytest.raises(SystemExit): serve_args(["--simulate-acceptance", "3"], env={})
    a = serve_args(["--model", str(tiny_ckpt), "--device", "cpu"], env={"DSPARK_SIMULATE_ACCEPTANCE": "3"})
    assert not hasattr(a, "simulate_acceptance") and "simulate_acceptance" not in a.llm_kwargs()


def test_bench_labels_its_records(tiny_ckpt):
    assert bench_args(["--simulate-acceptance", "3.34", "--device", "cpu"]).simulate_acceptance == 3.34
    assert bench_args(["--device", "cpu"]).simulate_acceptance is None
    with pytest.raises(SystemExit): bench_args(["--simulate-acceptance", "2", "--modes", "none"])
    with pytest.raises(ValueError, match=r"\[1, 6\]"):          # the block size bounds dspark: refused before any run
        run_bench(tiny_ckpt, modes=("none", "dspark"), concurrencies=(2,), device="cpu", simulate_acceptance=7.0)
    rec = run_bench(tiny_ckpt, modes=("none", "dspark"), concurrencies=(2,), max_tokens=6, prompt_len=8, device="cpu",
                    dtype="float32", backend="reference", kv_bytes=32 * 2**20, simulate_acceptance=3.34)
    none, spec = rec["decode"]
    assert rec["simulated_acceptance"] == 3.34 and spec["simulated_acceptance"] == 3.34 and "simulated_acceptance" not in none
    assert split_raw(rec)["config"]["simulated_acceptance"] == 3.34
    assert "simulated acceptance 3.34" in format_table(rec).splitlines()[0]
    assert "simulated" not in format_table({k: v for k, v in rec.items() if k != "simulated_acceptance"})


def test_the_confidence_head_is_calibrated_to_the_simulation(tiny_ckpt):
    """Under simulated acceptance every draft is accepted with probability p whatever it is, so the drafter's
    confidence logits are logit(p) on every path that makes them (greedy loop, sampled rows, masked loop), and
    capacity control reads survivals p^k; without the option they are the head's own."""
    from dspark.sample.sampling import RowParams
    llm = dspark.LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=K, device="cpu", simulate_acceptance=2.5,
                     kv_cache_memory_bytes=32 * 2**20)
    d, p = llm.runner.proposer.drafter, llm.runner.simulated.p
    want = math.log(p / (1 - p))
    assert d.confidence_logit == pytest.approx(want)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, d.block_size, d.cfg.hidden_size, generator=g).to(d.last.markov_head.markov_w1.weight.dtype)
    anchors, P = torch.tensor([3, 4, 5]), torch.tensor([10, 11, 12])
    _, greedy = d.greedy_from_hidden(h, anchors, K)
    U = d.base_logits(h)
    _, _, sampled = d.markov_rows(U, h, anchors, RowParams.of([dspark.SamplingParams(temperature=1.0)] * 3, [1, 2, 3], "cpu"), P, K)
    _, _, masked = d.markov_masked(h, anchors, P, K, RowParams.of([dspark.SamplingParams()] * 3, [0] * 3, "cpu"),
                                   lambda k, last: torch.ones(3, U.shape[-1], dtype=torch.bool), greedy=True)
    for conf in (greedy, sampled, masked):
        assert conf.shape == (3, K) and torch.allclose(conf, torch.full_like(conf, want))
    plain = dspark.LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=K, device="cpu", kv_cache_memory_bytes=32 * 2**20)
    assert plain.runner.proposer.drafter.confidence_logit is None
    _, own = plain.runner.proposer.drafter.greedy_from_hidden(h, anchors, K)
    assert not torch.allclose(own, torch.full_like(own, want))
