"""The engine's batched greedy fast paths equal the per-request reference they replace: verification on the
target's argmax tokens is `rejection_sample` at temperature 0, and one batched drafter forward over several
requests' context rings (read in place, rows outside each window masked) proposes exactly the drafts and
confidences of the per-request `propose`."""
import torch

import dspark
from dspark.model.drafter import load_drafter
from dspark.runtime.runner import greedy_verify
from dspark.sample.rejection import rejection_sample
from dspark.sample.sampling import SamplingParams
from dspark.spec.proposers import DSparkProposer

GREEDY = SamplingParams(temperature=0.0)


def test_greedy_verify_is_rejection_sampling_at_temperature_zero():
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        k = trial % 7
        logits = torch.randn(k + 1, 13, generator=g)
        logits[:, 3] = logits.max(-1).values                     # exact ties: both must take the first maximum
        top = logits.argmax(-1).tolist()
        drafts = [t if torch.rand(1, generator=g) < 0.7 else (t + 1) % 13 for t in top[:k]]
        assert greedy_verify(drafts, top) == rejection_sample(logits, drafts, None, GREEDY, 0, 5)


def test_batched_greedy_drafts_equal_per_request_drafts(tiny_ckpt):
    target = dspark.load_target(tiny_ckpt)
    drafter = load_drafter(tiny_ckpt, target)
    taps = tuple(target.cfg.dspark_target_layer_ids)
    w = target.cfg.sliding_window
    g = torch.Generator().manual_seed(1)
    pr = DSparkProposer(drafter, max_seqs=4, device="cpu")
    pr.confidence = {}
    lengths = {0: 9, 2: w + 20, 3: 40}                            # short, wrapped ring (longer than w), medium
    for slot, n in lengths.items():
        ids = torch.randint(0, target.cfg.vocab_size, (1, n), generator=g)
        feats = drafter.features(target(ids, taps=taps)[1])[0]
        pr.observe(slot, f"r{slot}", feats, torch.arange(n), ids[0].tolist())
    slots = list(lengths)
    anchors, P = [5, 77, 300], [lengths[s] for s in slots]
    n = [3, drafter.block_size, 1]
    batched = pr.propose_greedy(slots, [f"r{s}" for s in slots], anchors, P, n)
    conf_b = {rid: torch.as_tensor(c) for rid, (c, _) in pr.confidence.items()}   # floats from the batched step
    for i, s in enumerate(slots):
        drafts, q = pr.propose(s, f"r{s}", anchors[i], P[i], n[i], GREEDY, 0)
        assert batched[i] == drafts
        assert torch.allclose(conf_b[f"r{s}"], pr.confidence[f"r{s}"][0], atol=1e-5)
        assert torch.equal(q.argmax(-1), torch.tensor(drafts))   # the per-request q is one-hot on the drafts


def test_batched_observe_of_long_chunks_equals_per_request_observe(tiny_ckpt):
    "A prefill's last chunk longer than the ring joins the batch: observe_many keeps each request's newest w rows, as observe does."
    target = dspark.load_target(tiny_ckpt)
    drafter = load_drafter(tiny_ckpt, target)
    taps, w = tuple(target.cfg.dspark_target_layer_ids), target.cfg.sliding_window
    g = torch.Generator().manual_seed(2)
    one, many = DSparkProposer(drafter, max_seqs=3, device="cpu"), DSparkProposer(drafter, max_seqs=3, device="cpu")
    lengths = [3 * w + 5, w + 1, 7]                              # three ring-fulls and more, just past one, short
    feats, pos = [], []
    for n in lengths:
        ids = torch.randint(0, target.cfg.vocab_size, (1, n), generator=g)
        feats.append(drafter.features(target(ids, taps=taps)[1])[0]); pos.append(torch.arange(n))
    assert all(many.batchable(n) for n in lengths)
    for s, (f, p) in enumerate(zip(feats, pos)): one.observe(s, f"r{s}", f, p, [])
    many.observe_many([0, 1, 2], ["r0", "r1", "r2"], feats, pos)
    assert torch.equal(one.ctx.pos, many.ctx.pos), (one.ctx.rows - many.ctx.rows).abs().max()
    assert torch.allclose(one.ctx.rows, many.ctx.rows, atol=1e-5), (one.ctx.rows - many.ctx.rows).abs().max()
    args = [0, 1, 2], ["r0", "r1", "r2"], [5, 6, 7], lengths, [drafter.block_size] * 3
    assert one.propose_greedy(*args) == many.propose_greedy(*args)


def test_fused_rope_block_attention_equals_the_reference(tiny_ckpt):
    "The GPU fast path's drafter attention (one norm + RoPE kernel, Triton's interpreter here) against `Attention.qkv`/`output`."
    from dspark.kernels.fused import qkv_rope_insert_          # compiled on a GPU machine: the test runs there on the GPU
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    target = dspark.load_target(tiny_ckpt, device=dev)
    drafter = load_drafter(tiny_ckpt, target)
    cfg, R, g = target.cfg, 3, drafter.block_size
    gen = torch.Generator().manual_seed(2)
    n = 7
    rows = torch.randn(R, cfg.num_draft_stages, n, cfg.head_dim, generator=gen).to(dev)
    valid = (torch.rand(R, n, generator=gen) < 0.7).to(dev)
    anchors, P = torch.tensor([3, 50, 9], device=dev), torch.tensor([7, 30, 200], device=dev)
    ref_h = drafter.block_hidden(anchors, P, rows, valid)
    ref = drafter.propose_greedy(anchors, P, rows, valid, g)
    drafter.rope_kernel = qkv_rope_insert_
    h = drafter.block_hidden(anchors, P, rows, valid)
    fast = drafter.propose_greedy(anchors, P, rows, valid, g)
    assert torch.allclose(h, ref_h, atol=1e-4, rtol=1e-4)
    assert torch.equal(fast[0], ref[0]) and torch.allclose(fast[1], ref[1], atol=1e-4)
