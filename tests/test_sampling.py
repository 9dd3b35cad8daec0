"""Sampling: parameter validation, exact top-k/top-p sets, keyed streams, and the sampled distribution."""
import itertools

import pytest
import torch

import dspark
from dspark.sample.sampling import SamplingParams, keyed_uniform, probs, process_logits, sample


def naive_kept(logits, temperature, top_k, top_p):
    "Enumerate the kept set the slow way: sort by probability, keep top-k, then the nucleus."
    p = (logits / temperature).softmax(-1).tolist()
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if top_k != -1:
        kth = sorted(p, reverse=True)[top_k - 1]
        order = [i for i in order if p[i] >= kth]
    q = torch.tensor(p)[order]; q = (q / q.sum()).tolist()
    kept, mass = [], 0.0
    for i, qi in zip(order, q):
        if mass >= top_p: break
        kept.append(i); mass += qi
    return set(kept)


@pytest.mark.parametrize("top_k,top_p", list(itertools.product([-1, 1, 3, 7], [1.0, 0.9, 0.5, 0.05])))
def test_kept_set_matches_enumeration(top_k, top_p):
    g = torch.Generator().manual_seed(top_k * 100 + int(top_p * 100))
    for _ in range(20):
        lg = torch.randn(8, generator=g) * 2
        got = set(torch.isfinite(process_logits(lg, 0.8, top_k, top_p)).nonzero().flatten().tolist())
        assert got == naive_kept(lg, 0.8, top_k, top_p)


def test_sampled_distribution_matches_processed_probs():
    lg = torch.tensor([1.5, 1.0, 0.2, -0.3, -1.0, 0.7, -2.0, 0.0])
    sp = SamplingParams(temperature=1.3, top_p=0.8)
    target = probs(lg, sp).double()
    n = 30000
    counts = torch.bincount(torch.tensor([sample(lg, sp, 7, pos) for pos in range(n)]), minlength=8).double()
    support = target > 0
    assert counts[~support].sum() == 0
    chi2 = ((counts - n * target) ** 2 / (n * target))[support].sum().item()
    assert chi2 < 24.3, chi2          # p = 0.001 critical value for 7 dof (fewer here: conservative)


def test_streams_are_keyed_and_independent():
    a = keyed_uniform(1, 10, "draft", 16)
    assert torch.equal(a, keyed_uniform(1, 10, "draft", 16))
    for other in (keyed_uniform(2, 10, "draft", 16), keyed_uniform(1, 11, "draft", 16), keyed_uniform(1, 10, "accept", 16)):
        assert not torch.equal(a, other)


def test_greedy_is_argmax():
    lg = torch.randn(50)
    assert sample(lg, SamplingParams(temperature=0.0), 0, 3) == int(lg.argmax())


@pytest.mark.parametrize("kwargs,name", [
    (dict(temperature=-1), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_k=0), "top_k"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"), (dict(stop=[1, 2]), "stop"),
    (dict(stop=""), "stop"), (dict(seed="x"), "seed"), (dict(logprobs=-1), "logprobs"),
])
def test_bad_params_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        dspark.SamplingParams(**kwargs)
