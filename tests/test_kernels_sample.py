"""Keyed sampling on the device: Philox against its reference vectors, the Triton uniforms and draw against the
torch reference (CPU interpreter in CI, compiled where there is a GPU), the draw's distribution, batched row
processing, batched verification and drafting against their per-request forms, and seeded sampled requests
with DSpark independent of their batch."""
import pytest
import torch

import dspark
import dspark.model.drafter as D
from dspark.entrypoints.llm import LLM
from dspark.kernels.sample import draw_keyed_triton, draw_splits, keyed_uniforms_triton
from dspark.sample.rejection import rejection_sample, verify_keyed
from dspark.sample.sampling import (STREAMS, RowParams, SamplingParams, draw_keyed, keyed_uniform, keyed_uniforms, philox4x32,
                             probs, process_logits, process_rows, row_probs, sample)

DEV = "cuda" if torch.cuda.is_available() else "cpu"      # the kernels run compiled where they can


def test_philox_known_answer_vectors():
    "The three Philox4x32-10 vectors of the Random123 reference implementation (counter, key -> output)."
    z = lambda *v: [torch.tensor([x]) for x in v]
    cases = [((0, 0, 0, 0), (0, 0), (0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8)),
             ((2**32 - 1,) * 4, (2**32 - 1,) * 2, (0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd)),
             ((0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344), (0xa4093822, 0x299f31d0),
              (0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1))]
    for ctr, key, want in cases:
        assert tuple(int(w) for w in philox4x32(*z(*ctr), *z(*key))) == want


SEEDS = torch.tensor([0, 1, -5, 2**62, 123456789, -2**63, 7])
POS = torch.tensor([0, 5, 2**33 + 7, 100, 3, 9, 2**31 - 1])
STREAM = torch.tensor([0, 1, 2, 3, 0, 1, 2])


@pytest.mark.parametrize("n", [1, 5, 37, 1500])
def test_uniforms_kernel_is_bit_identical(n):
    ref = keyed_uniforms(SEEDS, POS, STREAM, n)
    got = keyed_uniforms_triton(SEEDS.to(DEV), POS.to(DEV), STREAM.to(DEV), n).cpu()
    assert torch.equal(got, ref)
    assert torch.equal(keyed_uniforms_triton(SEEDS[:4].view(2, 2).to(DEV), POS[:4].view(2, 2).to(DEV),
                                             STREAM[:4].view(2, 2).to(DEV), n).cpu(), ref[:4].view(2, 2, n))


def test_uniforms_are_uniform_and_streams_differ():
    u = keyed_uniform(3, 17, "sample", 200_000).double()
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    chi2 = float(((counts - 10_000) ** 2 / 10_000).sum())
    assert chi2 < 43.8, chi2                              # p = 0.001 for 19 dof
    others = [keyed_uniform(4, 17, "sample", 64), keyed_uniform(3, 18, "sample", 64), keyed_uniform(3, 17, "draft", 64)]
    assert all(float((o - u[:64].float()).abs().max()) > 0.1 for o in others)
    assert torch.equal(keyed_uniform(2**64 + 3, 17, "sample", 64), u[:64].float())    # seeds are taken mod 2^64


@pytest.mark.parametrize("splits", [1, 2, 3, 4])
def test_draw_kernel_equals_reference(splits):
    g = torch.Generator().manual_seed(splits)
    w = torch.rand(7, 2500, generator=g) ** 6
    w[0, ::2] = 0                                         # only odd tokens possible
    w[1, :] = 0; w[1, 1234] = 0.5                         # one possible token, in a later chunk
    ref = draw_keyed(w, SEEDS, POS, STREAM)
    got = draw_keyed_triton(w.to(DEV), SEEDS.to(DEV), POS.to(DEV), STREAM.to(DEV), splits=splits).cpu()
    assert torch.equal(got, ref)
    assert int(ref[0]) % 2 == 1 and int(ref[1]) == 1234


def test_draw_handles_strided_rows_and_bf16():
    w = torch.rand(3, 2, 600, generator=torch.Generator().manual_seed(0))[:, 1]          # row stride 1200
    ref = draw_keyed(w, SEEDS[:3], POS[:3], STREAM[:3])
    assert torch.equal(draw_keyed_triton(w.to(DEV), SEEDS[:3].to(DEV), POS[:3].to(DEV), STREAM[:3].to(DEV)).cpu(), ref)
    wb = w.to(torch.bfloat16)
    assert torch.equal(draw_keyed_triton(wb.to(DEV), SEEDS[:3].to(DEV), POS[:3].to(DEV), STREAM[:3].to(DEV)).cpu(),
                       draw_keyed(wb, SEEDS[:3], POS[:3], STREAM[:3]))
    assert draw_splits(1, 129280) > 1 and draw_splits(512, 129280) == 1


def test_keyed_draw_distribution():
    "Gumbel-max on the keyed streams draws from w / sum(w): 40,000 positions of one seed, chi-square."
    w = torch.tensor([0.3, 0.0, 0.05, 0.2, 0.15, 0.1, 0.2, 0.0])
    n = 40_000
    x = draw_keyed(w.expand(n, -1), torch.full((n,), 11), torch.arange(n), STREAMS["sample"])
    counts = torch.bincount(x, minlength=8).double()
    assert counts[w == 0].sum() == 0
    exp = n * w[w > 0].double() / w.sum()
    chi2 = float(((counts[w > 0] - exp) ** 2 / exp).sum())
    assert chi2 < 20.5, chi2                              # p = 0.001 for 5 dof


PARAMS = [SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.2, top_p=0.6), SamplingParams(),
          SamplingParams(temperature=0), SamplingParams(temperature=0.9, top_k=5, top_p=0.8), SamplingParams(top_k=1)]


def test_rows_of_different_requests_process_as_each_alone():
    lg = torch.randn(len(PARAMS), 40, generator=torch.Generator().manual_seed(0)) * 2
    lg[0, :4] = lg[0, 10]                                 # ties at the top-k cut are kept together
    rp = RowParams.of(PARAMS, list(range(len(PARAMS))), "cpu")
    batch = row_probs(lg, rp)
    for i, sp in enumerate(PARAMS):
        assert torch.equal(batch[i], probs(lg[i], sp)), sp
    assert torch.equal(process_rows(lg, torch.full((6,), 0.5)), process_logits(lg, 0.5))
    assert rp.top_k is not None and rp.top_p is not None and rp.greedy
    plain = RowParams.of([SamplingParams()] * 2, [0, 1], "cpu")
    assert plain.top_k is None and plain.top_p is None and not plain.greedy


def test_batched_verification_equals_per_request():
    "`verify_keyed` over a padded batch gives each request what `rejection_sample` gives it alone."
    g = torch.Generator().manual_seed(1)
    V, K = 24, 4
    n = [4, 0, 2, 3, 1, 4]
    lg = torch.randn(len(PARAMS), K + 1, V, generator=g) * 1.5
    qlg = lg[:, :K] + torch.randn(len(PARAMS), K, V, generator=g)         # a drafter close to the target
    seeds, pos = [5, 6, 7, 8, 2**63 + 9, -3], [10, 20, 30, 40, 50, 60]
    rp = RowParams.of(PARAMS, seeds, "cpu")
    q = row_probs(qlg.reshape(-1, V), rp.repeat(K)).view(-1, K, V)
    drafts = draw_keyed(q.reshape(-1, V), rp.seed.repeat_interleave(K),
                        (torch.tensor(pos)[:, None] + torch.arange(K)).reshape(-1), STREAMS["draft"]).view(-1, K)
    for i, k in enumerate(n): drafts[i, k:] = 0
    p = row_probs(lg.reshape(-1, V), rp.repeat(K + 1)).view(-1, K + 1, V)
    a, nxt = verify_keyed(p, q, drafts, torch.tensor(n), rp.seed, torch.tensor(pos))
    for i, sp in enumerate(PARAMS):
        one = rejection_sample(lg[i], drafts[i, :n[i]].tolist(), q[i], sp, seeds[i], pos[i])
        assert one == (int(a[i]), drafts[i, :a[i]].tolist() + [int(nxt[i])]), (i, sp)
    assert rejection_sample(lg[2], [], None, PARAMS[2], 5, 77) == (0, [sample(lg[2, 0], PARAMS[2], 5, 77)])


@pytest.fixture(scope="module")
def drafter(tiny_ckpt):
    target = dspark.load_target(tiny_ckpt)
    return D.load_drafter(tiny_ckpt, target)


def test_batched_markov_sampling_equals_per_request(drafter):
    "`markov_rows` for six requests of different settings equals `markov_sample` for each alone."
    g = torch.Generator().manual_seed(2)
    R, gam, V = len(PARAMS), drafter.block_size, drafter.cfg.vocab_size
    U = torch.randn(R, gam, V, generator=g) * 3
    h = torch.randn(R, gam, drafter.cfg.hidden_size, generator=g)
    anchors, P, seeds = torch.randint(0, V, (R,), generator=g), torch.arange(R) * 7 + 30, [11, 12, 13, 14, 15, 16]
    drafts, q, conf = drafter.markov_rows(U, h, anchors, RowParams.of(PARAMS, seeds, "cpu"), P, gam)
    for i, sp in enumerate(PARAMS):
        toks, qi, ci = drafter.markov_sample(U[i], h[i], int(anchors[i]), sp, seeds[i], int(P[i]))
        assert drafts[i].tolist() == toks, sp
        torch.testing.assert_close(q[i], qi)               # the Markov GEMM of 6 rows may round unlike 1 row's
        torch.testing.assert_close(conf[i], ci)
    hot = torch.nn.functional.one_hot(drafts[3], V).float()
    assert torch.equal(q[3], hot)                         # a greedy row's q is one-hot at its argmax draft


def test_seeded_dspark_sampling_independent_of_batch(tiny_ckpt):
    """Sampled and greedy requests with DSpark in one batch: each gets the tokens it gets alone (seeded), the
    greedy ones those of plain greedy decoding, and the batch drafts through the batched sampled proposer."""
    kv = dict(max_num_seqs=6, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (int(torch.randint(4, 40, (1,), generator=g)),), generator=g).tolist() for _ in PARAMS]
    sps = [SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, max_tokens=14, seed=100 + i,
                          ignore_eos=True) for i, sp in enumerate(PARAMS)]
    spec = LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=3, **kv)
    calls = []
    batched = spec.runner.proposer.propose_sampled
    spec.runner.proposer.propose_sampled = lambda *a: calls.append(len(a[0])) or batched(*a)
    together = [o.outputs[0].token_ids for o in spec.generate(prompts, sps, use_tqdm=False)]
    assert max(calls) > 1                                 # several requests drafted in one batch
    alone = [spec.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, sps)]
    assert together == alone
    plain = LLM(tiny_ckpt, **kv)
    for i in (3, 5):                                      # temperature 0, and top_k = 1: greedy in effect
        assert together[i] == plain.generate([prompts[i]], sps[i], use_tqdm=False)[0].outputs[0].token_ids
    assert spec.spec_stats()["num_drafts"] > 0


def test_draft_step_buffers_equal_the_eager_batched_proposer(tiny_ckpt):
    """The draft-step graphs' buffer layout, run eagerly (`capture=False`): mixed sampled and greedy requests get
    the same tokens as with the eager batched proposer, and padding rows write only the scratch slot's `q`."""
    from dspark.runtime.graphs import DraftGraphs
    kv = dict(max_num_seqs=6, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 512, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist() for _ in range(5)]
    sps = [SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, max_tokens=10, seed=50 + i,
                          ignore_eos=True) for i, sp in enumerate(PARAMS[:5])]
    ref = LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=3, **kv)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, sps, use_tqdm=False)]
    spec = LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=3, **kv)
    pr = spec.runner.proposer
    pr.graphs = DraftGraphs(pr, kv["max_num_seqs"], capture=False)
    scratch_before = pr.q[pr.ctx.scratch].clone()
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, sps, use_tqdm=False)]
    assert got == want and pr.graphs.replays > 0
    greedy = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)] * 3
    assert ([o.outputs[0].token_ids for o in spec.generate(prompts[:3], greedy, use_tqdm=False)] ==
            [o.outputs[0].token_ids for o in ref.generate(prompts[:3], greedy, use_tqdm=False)])
    assert not torch.equal(pr.q[pr.ctx.scratch], scratch_before)     # 5 requests in a bucket of 6: padding wrote there


@pytest.mark.parametrize("method", ["dspark", "mtp"])
def test_sampled_request_joining_greedy_ones_with_drafts(tiny_ckpt, tmp_path, method):
    """A sampled request arrives while greedy requests are verifying drafts, before any sampled draft exists:
    its first step (no drafts yet) verifies beside theirs, and every request gets its tokens as if alone."""
    ck = tiny_ckpt if method == "dspark" else dspark.make_tiny_checkpoint(tmp_path / "mtp", seed=3, drafter="mtp")
    kv = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
    ref = LLM(ck, speculative=method, num_speculative_tokens=2, **kv)
    greedy, sampled = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), SamplingParams(max_tokens=8, seed=5, ignore_eos=True)
    prompts = [[5, 9, 30, 31, 7], [100, 4, 2, 8]]
    alone = [ref.generate([prompts[0]], greedy, use_tqdm=False)[0].outputs[0].token_ids,
             ref.generate([prompts[1]], sampled, use_tqdm=False)[0].outputs[0].token_ids]
    llm = LLM(ck, speculative=method, num_speculative_tokens=2, **kv)   # fresh: no sampled draft made yet
    first = llm.add_request(prompts[0], greedy)
    for _ in range(3): llm.step()                         # the greedy request is verifying drafts now
    second = llm.add_request(prompts[1], sampled)
    while llm.has_unfinished_requests(): llm.step()
    assert [llm.pop_output(first).outputs[0].token_ids, llm.pop_output(second).outputs[0].token_ids] == alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_argmax_kernel_equals_unpacked_reference(dtype):
    "The one-launch masked argmax picks what unpacking, filling and `argmax` pick: ties, empty masks, wide words."
    from dspark.kernels.sample import masked_argmax_triton
    from dspark.sample.structured import pack_rows, unpack_masks
    g = torch.Generator().manual_seed(0)
    N, V = 9, 3000                                        # V not a multiple of 32 or of the kernel's block
    x = torch.randint(-3, 3, (N, V), generator=g).to(dtype)   # few values: ties everywhere
    W = (V + 31) // 32 + 2                                # the grammar's words may cover a larger tokenizer
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, W), generator=g, dtype=torch.int32).numpy()
    words[1] = 0                                          # allows nothing: index 0, as the reference
    words[2] = 0; words[2, 40] = 1 << 7                   # one token
    words[3] &= 0x01010101                                # sparse
    rows = [0, 3, 4, 7, 8]
    want = torch.full((N,), -1, dtype=torch.long)
    want[rows] = x[rows].float().masked_fill(~unpack_masks(words, V), float("-inf")).argmax(-1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the device's compiled kernel there, the interpreter here
    got = torch.full((N,), -1, dtype=torch.long, device=dev)
    packed = pack_rows(rows, [words[:2], words[2:]], V)   # two requests' rows, as the engine hands them
    masked_argmax_triton(x.to(dev), got, packed.to(dev))
    got = got.cpu()
    assert torch.equal(got, want)
    assert got[3] == 0 and got[4] == 40 * 32 + 7
