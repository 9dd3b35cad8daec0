"""Rejection sampling: the exact output distribution over 10^6 vectorised rounds (and two mutations it must
catch), the analytic acceptance rate, greedy exactness, the per-request wrapper on keyed streams, stop
truncation and acceptance accounting (reference dspark.md §4.2-4.3, §8.7, §8.13)."""
import pytest
import torch

import dspark.sample.rejection as rj
from dspark.sample.rejection import SpecStats, accepted_length, gumbel, rejection_sample, truncate_at_stop, verify
from dspark.sample.sampling import SamplingParams, probs, sample

N, V = 1_000_000, 8


def pvalue(counts: torch.Tensor, p: torch.Tensor) -> float:
    """Chi-square goodness of fit of `counts` to `p`; cells expected below 5 are pooled. Tokens with p = 0
    must never occur (asserted, not tested statistically)."""
    counts, p = counts.double().flatten(), p.double().flatten()
    assert counts[p == 0].sum() == 0, "emitted a token of probability 0"
    e = p * counts.sum()
    big, small = e >= 5, (e < 5) & (p > 0)
    obs, exp = counts[big], e[big]
    if small.any(): obs, exp = torch.cat([obs, counts[small].sum()[None]]), torch.cat([exp, e[small].sum()[None]])
    chi2 = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2, dtype=torch.float64), chi2 / 2))


@pytest.fixture
def one_thread():
    """Tests that call the per-request wrapper thousands of times on tiny tensors: with two OpenMP threads
    every small op pays a fork-join barrier, which costs milliseconds when the 2-core machine is busy."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand_dist(gen, *shape, scale=1.5):
    return (torch.randn(*shape, V, generator=gen) * scale).softmax(-1)


def noise(gen, *shape):
    "Gumbel noise from uniforms in (0, 1)."
    return gumbel(torch.rand(*shape, generator=gen).clamp_(1e-12, 1 - 1e-7))


def sample_rows(q, gen):
    "One index per row of `q [N, V]` by inverse CDF (exact, and far faster than multinomial at N = 10^6)."
    cdf = q.cumsum(-1)
    u = torch.rand(q.shape[0], 1, generator=gen).clamp_(1e-12) * cdf[:, -1:]
    return (cdf < u).sum(-1).clamp_(max=q.shape[-1] - 1)


def tables(kind: str, K: int, gen):
    """A Markov target and drafter: p0 [V] and T [K, V, V] with T[j][x] the target row j+1 given the previous
    token x; q1 [V] and D [K-1, V, V] with D[j][x] the draft distribution for draft j+2 given draft j+1 = x."""
    p0, T, q1, D = rand_dist(gen), rand_dist(gen, K, V), rand_dist(gen), rand_dist(gen, K - 1, V)
    if kind == "zero_q":        # q misses half the vocabulary (different halves per row); p has full support
        keep = lambda d: d * (torch.rand(d.shape, generator=gen) < 0.5).float().index_fill_(-1, torch.tensor([0]), 1)
        q1, D = keep(q1), keep(D)
        q1, D = q1 / q1.sum(-1, keepdim=True), D / D.sum(-1, keepdim=True)
    elif kind == "q_eq_p":
        q1, D = p0.clone(), T[:K - 1].clone()
    elif kind == "disjoint":    # p on {0..3}, q on {4..7}
        lo = torch.arange(V) < V // 2
        p0, T = p0 * lo, T * lo
        q1, D = q1 * ~lo, D * ~lo
        p0, T, q1, D = (t / t.sum(-1, keepdim=True) for t in (p0, T, q1, D))
    elif kind == "onehot_q":    # greedy drafter that proposes the target's mode; sampled target
        q1 = torch.nn.functional.one_hot(p0.argmax(-1), V).float()
        D = torch.nn.functional.one_hot(T[:K - 1].argmax(-1), V).float()
    return p0, T, q1, D


def simulate(p0, T, q1, D, n_drafts, gen, shared_noise=False):
    """Two rounds of speculative decoding for N independent sequences; returns the first two committed tokens
    and round one's accepted counts. Round two (anchor = round one's token) supplies the second token when
    round one committed only one. Each round makes exactly one Gumbel draw, so one noise vector per sequence,
    broadcast over the K+1 rows, is as good as K+1 independent ones."""
    K = T.shape[0]
    drafts, q_rows, p_rows = [], [], [p0.expand(N, V)]
    g1 = noise(gen, N, V)
    for j in range(K):
        qj = q1.expand(N, V) if j == 0 else D[j - 1][drafts[-1]]
        if shared_noise and j == 0: x = (qj.log() + g1).argmax(-1)     # vLLM bug: draft noise = recovery noise
        else: x = sample_rows(qj, gen)
        drafts.append(x); q_rows.append(qj); p_rows.append(T[j][x])
    x, q, p = torch.stack(drafts, 1), torch.stack(q_rows, 1), torch.stack(p_rows, 1)
    a, nxt = verify(p, q, x, n_drafts, torch.rand(N, K, generator=gen), g1[:, None].expand(N, K + 1, V))
    first = torch.where(a >= 1, x[:, 0], nxt)
    # round two: anchor `first`, one draft from D[0][first], verified by T[0][first]
    q2 = D[0][first]
    x2 = sample_rows(q2, gen)[:, None]
    p2 = torch.stack([T[0][first], T[1 % K][x2[:, 0]]], 1)
    a2, nxt2 = verify(p2, q2[:, None], x2, torch.ones(N, dtype=torch.long), torch.rand(N, 1, generator=gen),
                      noise(gen, N, 1, V).expand(N, 2, V))
    second2 = torch.where(a2 >= 1, x2[:, 0], nxt2)
    second = torch.where(a >= 2, x[:, 1], torch.where(a == 1, nxt, second2))
    return first, second, a


def joint_pvalue(p0, T, first, second):
    counts = torch.bincount(first * V + second, minlength=V * V)
    return pvalue(counts, p0[:, None] * T[0])


CASES = [("random", 2, "full"), ("random", 3, "mixed"), ("zero_q", 3, "full"), ("q_eq_p", 3, "mixed"),
         ("disjoint", 2, "full"), ("onehot_q", 3, "mixed")]


@pytest.mark.parametrize("kind,K,n_mode", CASES)
def test_first_two_tokens_are_target_distributed(kind, K, n_mode):
    gen = torch.Generator().manual_seed(CASES.index((kind, K, n_mode)))
    p0, T, q1, D = tables(kind, K, gen)
    n = torch.full((N,), K) if n_mode == "full" else torch.randint(0, K + 1, (N,), generator=gen)
    first, second, a = simulate(p0, T, q1, D, n, gen)
    assert (a <= n).all()
    if kind == "q_eq_p": assert torch.equal(a, n), "q = p must accept every draft"
    if kind == "disjoint": assert (a == 0).all(), "disjoint supports must reject every draft"
    pv = joint_pvalue(p0, T, first, second)
    assert pv > 1e-3, f"{kind}: chi-square p-value {pv:.2e}"


def test_residual_replaced_by_p_is_caught(monkeypatch):
    "The same test rejects the classic bug 'on rejection, resample from p'."
    gen = torch.Generator().manual_seed(7)
    p0, T, q1, D = tables("random", 2, gen)
    monkeypatch.setattr(rj, "residual", lambda p_a, q_next: p_a)
    first, second, _ = simulate(p0, T, q1, D, torch.full((N,), 2), gen)
    assert joint_pvalue(p0, T, first, second) < 1e-12


def test_shared_draft_and_recovery_noise_is_caught():
    "Drafting with the recovery stream's Gumbel noise (serving.md §1.3) biases the output; the test sees it."
    gen = torch.Generator().manual_seed(8)
    p0, T, q1, D = tables("random", 2, gen)
    first, second, _ = simulate(p0, T, q1, D, torch.full((N,), 2), gen, shared_noise=True)
    assert joint_pvalue(p0, T, first, second) < 1e-12


@pytest.mark.parametrize("kind", ["random", "zero_q", "onehot_q"])
def test_acceptance_probability_is_one_minus_tv(kind):
    gen = torch.Generator().manual_seed(11)
    p0, T, q1, _ = tables(kind, 2, gen)
    x = sample_rows(q1.expand(N, V), gen)[:, None]
    a = accepted_length(p0.expand(N, 2, V), q1.expand(N, 1, V), x, torch.ones(N, dtype=torch.long),
                        torch.rand(N, 1, generator=gen))
    exact = torch.minimum(p0, q1).sum().item()
    assert abs(exact - (1 - 0.5 * (p0 - q1).abs().sum().item())) < 1e-6
    assert abs(a.double().mean().item() - exact) < 5 * (exact * (1 - exact) / N) ** 0.5 + 1e-9


def test_verify_edge_rows():
    "q(x) = 0 rejects even where p(x) = 1; padding beyond n_drafts is never read; residual mass ~ 0 falls back to p."
    p = torch.nn.functional.one_hot(torch.tensor([[2, 3, 4]]), V).float()
    q = torch.zeros(1, 2, V); q[0, :, 5] = 1.0
    a, nxt = verify(p, q, torch.tensor([[2, 3]]), torch.tensor([2]), torch.full((1, 2), 1e-9), torch.zeros(1, 3, V))
    assert (a.item(), nxt.item()) == (0, 2)
    a, nxt = verify(p, p[:, :2], torch.tensor([[2, -1]]), torch.tensor([1]), torch.rand(1, 2), torch.zeros(1, 3, V))
    assert (a.item(), nxt.item()) == (1, 3)                       # bonus from row 1, padding -1 ignored
    pp = rand_dist(torch.Generator().manual_seed(0), 1, 2)
    a, nxt = verify(pp, pp[:, :1], torch.tensor([[1]]), torch.tensor([1]), torch.tensor([[1.0]]), torch.zeros(1, 2, V))
    assert a.item() == 0 and pp[0, 0, nxt.item()] > 0               # forced rejection with p = q: fallback to p_0


def argmax_chain_case(gen, K, Vg=50):
    lg = torch.randn(K + 1, Vg, generator=gen)
    chain = lg.argmax(-1).tolist()
    m = int(torch.randint(0, K + 1, (1,), generator=gen))        # first mismatch (K: none)
    drafts = chain[:m] + [(c + 1 + int(torch.randint(0, Vg - 1, (1,), generator=gen))) % Vg for c in chain[m:K]]
    return lg, chain, drafts, m


def test_greedy_is_the_argmax_chain(one_thread):
    gen, greedy = torch.Generator().manual_seed(3), SamplingParams(temperature=0)
    for trial in range(300):
        K = trial % 6
        lg, chain, drafts, m = argmax_chain_case(gen, K)
        junk_q = torch.rand(K, 50, generator=gen)                  # ignored when greedy
        a, toks = rejection_sample(lg, drafts, junk_q, greedy, seed=trial, position=17)
        assert (a, toks) == (m, chain[:m + 1])


def test_greedy_core_with_one_hot_is_noise_free():
    gen = torch.Generator().manual_seed(4)
    K, n = 4, 2000
    lg = torch.randn(n, K + 1, 16, generator=gen)
    chain = lg.argmax(-1)
    drafts = torch.where(torch.rand(n, K, generator=gen) < 0.8, chain[:, :K], torch.randint(0, 16, (n, K), generator=gen))
    p, q = torch.nn.functional.one_hot(chain, 16).float(), torch.nn.functional.one_hot(drafts, 16).float()
    a, nxt = verify(p, q, drafts, torch.full((n,), K), torch.rand(n, K, generator=gen), noise(gen, n, K + 1, 16))
    want = (drafts == chain[:, :K]).long().cumprod(-1).sum(-1)
    assert torch.equal(a, want) and torch.equal(nxt, chain[torch.arange(n), a])


def test_scripted_patterns_and_stats(one_thread):
    "Drafts forced to accept 5, 0 and 2 of 5 (reference §8.13)."
    lg = torch.full((6, 32), -1.0)
    lg[torch.arange(6), 10 + torch.arange(6)] = 5.0                 # argmax chain 10..15
    chain, st = list(range(10, 16)), SpecStats()
    for drafts, want in [([10, 11, 12, 13, 14], 5), ([3, 11, 12, 13, 14], 0), ([10, 11, 7, 13, 14], 2)]:
        a, toks = rejection_sample(lg, drafts, None, SamplingParams(temperature=0), seed=0, position=40)
        assert (a, toks) == (want, chain[:want + 1])
        st.record(len(drafts), a)
    st.record(0, 0)                                                 # plain decode round: not a draft
    d = st.as_dict()
    assert (d["num_drafts"], d["num_draft_tokens"], d["num_accepted_tokens"]) == (3, 15, 7)
    assert d["accepted_per_position"] == [2, 2, 1, 1, 1]
    assert d["mean_acceptance_length"] == pytest.approx(1 + 7 / 3)
    assert d["draft_acceptance_rate"] == pytest.approx(7 / 15)
    st.record(7, 1)                                                 # a longer round grows the list
    assert st.accepted_per_position == [3, 2, 1, 1, 1, 0, 0]
    assert SpecStats().mean_acceptance_length == 0.0
    with pytest.raises(ValueError): st.record(2, 3)
    with pytest.raises(ValueError): st.record(2, -1)


PARAMS = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.2, top_p=0.6),
          SamplingParams(temperature=1.0), SamplingParams(temperature=0)]


@pytest.mark.parametrize("sp", PARAMS)
def test_no_drafts_is_plain_sample(sp, one_thread):
    gen = torch.Generator().manual_seed(5)
    lg = torch.randn(1, 40, generator=gen) * 2
    for pos in range(200):
        assert rejection_sample(lg, [], None, sp, seed=9, position=pos) == (0, [sample(lg[0], sp, 9, pos)])


@pytest.mark.parametrize("sp", PARAMS)
def test_same_seed_and_position_same_round(sp, one_thread):
    gen = torch.Generator().manual_seed(6)
    lg, dlg = torch.randn(4, 16, generator=gen), torch.randn(3, 16, generator=gen)
    q = probs(dlg, sp)
    results = set()
    for seed in range(40):
        drafts = [sample(dlg[i], sp, seed, 30 + i, stream="draft") for i in range(3)]
        r = rejection_sample(lg, drafts, q, sp, seed, 30)
        assert r == rejection_sample(lg, drafts, q.clone(), sp, seed, 30)
        assert r[1][:r[0]] == drafts[:r[0]] and len(r[1]) == r[0] + 1
        results.add((r[0], tuple(r[1])))
    if not sp.greedy: assert len(results) > 1


def test_draft_outside_target_top_k_always_rejected(one_thread):
    sp = SamplingParams(temperature=1.0, top_k=2)
    gen = torch.Generator().manual_seed(12)
    lg = torch.randn(2, 8, generator=gen)
    top = set(lg[0].topk(2).indices.tolist())
    out = [v for v in range(8) if v not in top]
    q = torch.full((1, 8), 1 / 8)                                    # a drafter that ignored top-k
    for seed in range(100):
        x = out[seed % len(out)]
        a, toks = rejection_sample(lg, [x], q, sp, seed, 5)
        assert a == 0 and toks[0] in top


def test_wrapper_first_token_distribution(one_thread):
    "End to end on the keyed streams: drafts from 'draft', acceptance from 'accept', recovery from 'recover'."
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    lg = torch.tensor([[0.5, 1.0, -0.5, 0.0, 1.5, -1.0], [0.0] * 6])
    dlg = torch.tensor([[1.5, 0.0, 0.5, -1.0, 0.0, 0.5]])
    q = probs(dlg, sp)
    n = 6000
    firsts = []
    for seed in range(n):
        x = sample(dlg[0], sp, seed, 100, stream="draft")
        firsts.append(rejection_sample(lg, [x], q, sp, seed, 100)[1][0])
    assert pvalue(torch.bincount(torch.tensor(firsts), minlength=6), probs(lg[0], sp)) > 1e-3


@pytest.mark.parametrize("tokens,stops,want", [
    ([], {2}, []), ([5, 9], {2}, [5, 9]), ([2, 5], {2}, [2]), ([5, 2, 9, 2], {2}, [5, 2]),
    ([5, 9, 7], {7, 9}, [5, 9]), ([5, 9, 7], set(), [5, 9, 7]), ([5, 9, 7], {7}, [5, 9, 7]),
])
def test_truncate_at_stop(tokens, stops, want):
    assert truncate_at_stop(tokens, stops) == want


def test_wrapper_rejects_short_inputs():
    sp = SamplingParams(temperature=1.0)
    with pytest.raises(ValueError, match="target rows"): rejection_sample(torch.zeros(2, 8), [1, 2], torch.ones(2, 8) / 8, sp, 0, 0)
    with pytest.raises(ValueError, match="draft_probs"): rejection_sample(torch.zeros(3, 8), [1, 2], None, sp, 0, 0)
