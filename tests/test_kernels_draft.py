"""The draft step's Triton kernels (nbs/17_kernels_draft) against their torch references, and the drafter with them
against the drafter without. On a machine without CUDA they run under Triton's interpreter at small shapes."""
import os

import numpy as np
import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import pytest

pytest.importorskip("triton")

import dspark
from dspark.model.drafter import load_drafter
from dspark.kernels.draft import draft_block_attention, draft_block_attention_ref
from dspark.kernels.markov import MARKOV_TILE_PROGRAMS, markov_chunk, markov_greedy_ref, markov_greedy_triton, markov_tiles
from dspark.kernels.hc import aten_launches

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("R,G,V,D,rank,n,dtype", [
    (3, 5, 120, 24, 8, 5, torch.float32),        # one split
    (2, 4, 1100, 16, 12, 2, torch.float32),      # nine splits, fewer positions than the block
    (2, 5, 1500, 16, 8, 5, torch.bfloat16),      # the linear rounded to bf16 before the add
    (3, 5, 1500, 16, 32, 5, torch.bfloat16),     # a 16-row block a program: each W₂ tile read once for the rows
    (20, 3, 700, 8, 16, 3, torch.float32),       # two row blocks, the second one mostly padding
    (3, 5, 120, 24, 16, 5, torch.float32),       # a row block, one split
    (2, 4, 1100, 16, 64, 2, torch.float16),
])
def test_markov_kernel_equals_the_loop(R, G, V, D, rank, n, dtype):
    g = torch.Generator().manual_seed(V)
    U = torch.randn(R, G, V, generator=g).to(DEV)
    h = torch.randn(R, G, D, generator=g).to(dtype).to(DEV)
    w1, w2 = (torch.randn(V, rank, generator=g).to(dtype).to(DEV) for _ in range(2))
    cw = torch.randn(D + rank, generator=g).to(dtype).to(DEV)
    anchors = torch.randint(0, V, (R,), generator=g).to(DEV)
    drafts, conf = markov_greedy_triton(U, h, anchors, w1, w2, cw, n)
    ref_drafts, ref_conf = markov_greedy_ref(U, h, anchors, w1, w2, cw, n)
    assert torch.equal(drafts, ref_drafts)
    assert torch.allclose(conf, ref_conf, atol=1e-4), (conf - ref_conf).abs().max()
    alone, none = markov_greedy_triton(U, h, anchors, w1, w2, None, n)
    assert none is None and torch.equal(alone, ref_drafts)
    if dtype != torch.float32:                  # the head's own 16-bit logits, widened in the kernel: the same drafts as
        U16 = U.to(dtype)                       # the reference given them cast to fp32 (no fp32 copy of U is launched)
        d16, c16 = markov_greedy_triton(U16, h, anchors, w1, w2, cw, n)
        r16, rc16 = markov_greedy_ref(U16.float(), h, anchors, w1, w2, cw, n)
        assert torch.equal(d16, r16) and torch.allclose(c16, rc16, atol=1e-4)


def test_markov_kernel_breaks_ties_as_argmax():
    """The same maximum inside one tile, in two tiles of a split, and in two splits: the lowest token id wins (512-id
    chunks, so a split has several tiles; the default chunk for so few programs is one tile)."""
    U = torch.zeros(3, 2, 1100)
    U[0, :, 700] = U[0, :, 1000] = 1.0                 # two splits
    U[1, :, 130] = U[1, :, 5] = 2.0                    # two tiles of split 0
    U[2, :, 9] = U[2, :, 8] = 3.0                      # one tile
    z = torch.zeros(1100, 4)
    drafts, _ = markov_greedy_triton(U.to(DEV), torch.zeros(3, 2, 4, device=DEV), torch.tensor([0, 1, 2], device=DEV),
                                     z.to(DEV), z.to(DEV), None, 2, chunk=512)
    assert drafts.tolist() == [[700, 700], [5, 5], [8, 8]]
    assert markov_chunk(1, 4096) == 128 and markov_chunk(64, 4096) == 256 and markov_chunk(1, 129280) == 128
    z = torch.zeros(1100, 16)                           # the same ties in 16-row blocks (a rank wide enough for them)
    U = torch.cat([U, U, U, U, U, U])                   # 18 rows: two blocks, each row's ties where its pattern puts them
    drafts, _ = markov_greedy_triton(U.to(DEV), torch.zeros(18, 2, 4, device=DEV), torch.arange(18, device=DEV),
                                     z.to(DEV), z.to(DEV), None, 2, chunk=512)
    assert markov_tiles(18, 1100, 16, 512).block_m == 16 and drafts.tolist() == [[700, 700], [5, 5], [8, 8]] * 6


def test_markov_tiles_choose_row_blocks():
    "One row a program for a single request or a rank too narrow for a tensor-core product; 16-row blocks otherwise."
    assert markov_tiles(1, 129280, 256).block_m == 1 and markov_tiles(4, 129280, 8).block_m == 1
    t = markov_tiles(64, 129280, 256)
    assert (t.block_m, t.grid[0]) == (16, 4) and t.grid[0] * t.splits <= MARKOV_TILE_PROGRAMS and t.chunk % t.block_v == 0


@pytest.mark.parametrize("R,G,H,Dh,NC,dtype", [
    (2, 5, 4, 32, 40, torch.float32),
    (3, 3, 20, 16, 70, torch.bfloat16),                # two head groups, a block length that is no power of two
    (1, 5, 4, 128, 133, torch.float32),                # the embedded model's shape
    (2, 5, 4, 128, 133, torch.bfloat16),               # ... in bf16: both products on tensor cores
    (2, 5, 4, 64, 70, torch.float16),                  # fp16 takes the same path, in its own 16-bit type
    (1, 2, 20, 512, 40, torch.bfloat16),               # V4-wide heads: smaller key tiles, more warps
])
def test_block_attention_equals_sink_attention(R, G, H, Dh, NC, dtype):
    g = torch.Generator().manual_seed(NC)
    q = torch.randn(R, G, H, Dh, generator=g).to(dtype).to(DEV)
    ring = torch.randn(R, 2, NC, Dh, generator=g).to(dtype).to(DEV)          # a stage of a two-stage ring, strided
    kv = torch.randn(R, G, Dh, generator=g).to(dtype).to(DEV)
    valid = torch.rand(R, NC, generator=g) < 0.6
    valid[0] = False                                                        # no context yet: the block and the sink
    sink = torch.randn(H, generator=g).to(DEV)
    out = draft_block_attention(q, ring[:, 1], valid.to(DEV), kv, sink, Dh ** -0.5)
    ref = draft_block_attention_ref(q, ring[:, 1], valid.to(DEV), kv, sink, Dh ** -0.5)
    # 16-bit inputs take the tensor-core path: p·v with p carried to 16 bits (hi + lo), ~2^-17 relative per term,
    # far below the bf16 rounding the drafter applies to this output next
    tol = 1e-5 if dtype == torch.float32 else 5e-5
    assert out.dtype == torch.float32 and torch.allclose(out, ref, atol=tol), (out - ref).abs().max()
    # the rings read in place: request i's rows are ring slots[i] of a larger ring (stage 1 of each), no gather first
    slots = torch.tensor([(2 * i + 1) % (R + 2) for i in range(R)])
    rings = torch.randn(R + 2, 2, NC, Dh, generator=g).to(dtype)
    rings[slots] = ring.cpu()
    inplace = draft_block_attention(q, rings.to(DEV)[:, 1], valid.to(DEV), kv, sink, Dh ** -0.5, slots=slots.to(DEV))
    assert torch.equal(inplace, out)


def test_kernels_cut_the_launches():
    "What a GPU would launch: γ + 1 kernels for the loop and its confidence head, one for a stage's attention."
    r = lambda *shape: torch.randn(*shape, device=DEV)
    U, h, w, cw, anchors = r(2, 5, 600), r(2, 5, 32), r(600, 8), r(40), torch.tensor([1, 2], device=DEV)
    fast = aten_launches(markov_greedy_triton, U, h, anchors, w, w, cw, 5)
    slow = aten_launches(markov_greedy_ref, U, h, anchors, w, w, cw, 5)
    assert fast["triton:_markov_step_kernel"] == 6 and sum(fast.values()) < sum(slow.values()) // 2, (fast, slow)
    q, ctx, kv = r(1, 5, 4, 32), r(1, 20, 32), r(1, 5, 32)
    valid = torch.ones(1, 20, dtype=torch.bool, device=DEV)
    first = aten_launches(draft_block_attention, q, ctx, valid, kv, torch.zeros(4, device=DEV), 0.1)
    assert first["triton:_block_attn_kernel"] == 1 and sum(first.values()) <= 2, first   # the process's first call
    # may also allocate the merge counters, once (a graph's warm-up does it before capture); every call after is one launch
    fast = aten_launches(draft_block_attention, q, ctx, valid, kv, torch.zeros(4, device=DEV), 0.1)
    assert fast == {"triton:_block_attn_kernel": 1}, fast


def test_drafter_with_the_kernels_drafts_as_without(tiny_ckpt):
    "The drafter's greedy proposals with both kernels (as `graphs.fast_path` sets them on a GPU) against its torch path."
    target = dspark.load_target(tiny_ckpt, device=DEV)
    drafter = load_drafter(tiny_ckpt, target)
    cfg, R, g = target.cfg, 3, drafter.block_size
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(R, cfg.num_draft_stages, 9, cfg.head_dim, generator=gen).to(DEV)
    valid = (torch.rand(R, 9, generator=gen) < 0.7).to(DEV)
    valid[1] = False
    anchors, P = torch.tensor([3, 50, 9], device=DEV), torch.tensor([7, 0, 200], device=DEV)
    ref_h = drafter.block_hidden(anchors, P, rows, valid)
    ref = drafter.propose_greedy(anchors, P, rows, valid, g)
    drafter.attn_kernel, drafter.markov_kernel = draft_block_attention, markov_greedy_triton
    with torch.no_grad(): h = drafter.block_hidden(anchors, P, rows, valid)
    fast = drafter.propose_greedy(anchors, P, rows, valid, g)
    assert torch.allclose(h, ref_h, atol=1e-4, rtol=1e-4), (h - ref_h).abs().max()
    assert torch.equal(fast[0], ref[0]) and torch.allclose(fast[1], ref[1], atol=1e-4)
    short = drafter.propose_greedy(anchors, P, rows, valid, 2)                # fewer drafts than the block
    assert torch.equal(short[0], ref[0][:, :2])


def test_check_passes_and_catches_a_wrong_kernel(tiny_ckpt, monkeypatch):
    """`draft_kernels_check` (what `graphs.fast_path` asks before switching the kernels on) passes them, and fails a
    Markov kernel whose drafts are one token off, an attention that is off by a scale, and one that raises."""
    import dspark.kernels.draft as kd
    drafter = load_drafter(tiny_ckpt, dspark.load_target(tiny_ckpt, device=DEV))
    assert kd.draft_kernels_check(drafter) is None
    good_markov, good_attn = kd.markov_greedy_triton, kd.draft_block_attention
    monkeypatch.setattr(kd, "markov_greedy_triton", lambda *a: (lambda d, c: ((d + 1) % 512, c))(*good_markov(*a)))
    assert "Markov draft 0" in kd.draft_kernels_check(drafter)
    assert markov_tiles(3, drafter.cfg.vocab_size, drafter.last.markov_head.markov_w1.weight.shape[1]).block_m == 16
    off_in_blocks = lambda U, *a: (lambda d, c: ((d + (len(d) > 1)) % 512, c))(*good_markov(U, *a))
    monkeypatch.setattr(kd, "markov_greedy_triton", off_in_blocks)    # right for one row, wrong for a row block
    assert "Markov draft 0 of row 0 of 3" in kd.draft_kernels_check(drafter)
    monkeypatch.setattr(kd, "markov_greedy_triton", good_markov)
    monkeypatch.setattr(kd, "draft_block_attention", lambda *a, **k: good_attn(*a, **k) * 1.01)
    assert "block attention differs" in kd.draft_kernels_check(drafter)
    def broken(*a, **k): raise RuntimeError("PTX assembly failed")
    monkeypatch.setattr(kd, "draft_block_attention", broken)
    assert kd.draft_kernels_check(drafter) == "RuntimeError: PTX assembly failed"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test above compiles the kernels for real")
def test_kernels_compile_for_hopper():
    """The interpreter never compiles a kernel, so both are compiled here for sm_90 with the signatures the GPU's JIT
    would see: the embedded model's drafter in bf16 (as `draft_kernels_check` runs it on a GPU) and a one-split
    vocabulary in fp32 without the confidence head. Step `k == 1` is its own specialisation (the JIT turns a 1 into a
    constant) and once failed to compile; a kernel given a non-power-of-two block must fail, so the check can."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.kernels.draft import draft_kernels_check
    from kernel_compile import compile_all, record
    drafter = load_drafter(DEFAULT_MODEL, dspark.load_target(DEFAULT_MODEL, device="cpu", dtype="bfloat16"))
    sigs = []
    with record(sigs):
        assert draft_kernels_check(drafter) is None
        w = torch.randn(100, 8)
        markov_greedy_triton(torch.randn(2, 5, 100), torch.randn(2, 5, 16), torch.tensor([1, 2]), w, w, None, 5)
    names = {s[1] for s in sigs}
    assert names == {"_markov_step_kernel", "_markov_block_kernel", "_block_attn_kernel", "_handover_kernel",
                     "_window_kernel", "_advance_kernel"}, names
    assert any(s[3].get("k") == 1 for s in sigs) and any(s[3].get("SPLITS") == 1 for s in sigs)
    bad = [s[0], s[1], dict(s[2]), {**s[3], "BLOCK_V": 48}, s[4]] if (s := sigs[-1]) else None
    failed = compile_all(sigs + [bad])
    assert len(failed) == 1 and '"BLOCK_V": 48' in failed[0], "\n".join(failed)


@pytest.mark.parametrize("width", [6, 5, 2])
def test_round_handover_kernel_equals_the_reference(width):
    "Accepted counts, anchors, positions and ring slots from the kernel and from `kernels.round.round_handover`."
    from dspark.kernels.round import round_handover
    from dspark.kernels.round import round_handover_triton
    g = torch.Generator().manual_seed(width)
    R, pad = 7, 3                                   # seven requests, three padding rows after them
    drafts = torch.randint(0, width, (R,), generator=g)
    first = torch.cat([torch.zeros(1, dtype=torch.long), (drafts + 1).cumsum(0)[:-1]])
    N = int((drafts + 1).sum()) + pad
    ids = torch.randint(0, 4, (N,), generator=g)                  # a small vocabulary: many matches
    top = torch.where(torch.rand(N, generator=g) < 0.7, torch.roll(ids, -1), torch.randint(0, 4, (N,), generator=g))
    tok_pos = torch.randint(0, 300, (N,), generator=g).int()
    tok_pos[1] = -1                                              # request 1's anchor row is padding: the scratch ring
    ring_slot = torch.randint(0, 16, (N,), generator=g)
    first, drafts = torch.cat([first, torch.zeros(2, dtype=torch.long)]), torch.cat([drafts, torch.zeros(2, dtype=torch.long)])
    args = lambda: (ids.to(DEV), first.to(DEV), drafts.to(DEV), tok_pos.to(DEV), ring_slot.to(DEV), 99, width)
    v_ref, v_fast = (torch.cat([top, torch.full((R + 2,), -7)]).to(DEV) for _ in range(2))
    ref = round_handover(v_ref, *args())
    fast = round_handover_triton(v_fast, *args())
    assert torch.equal(v_fast, v_ref), (v_fast[N:], v_ref[N:])
    for a, b in zip(fast, ref): assert torch.equal(a, b), (a, b)
    assert 0 < int(v_ref[N:].sum()) < int(drafts.sum())           # some drafts accepted, not all
    with pytest.raises(ValueError, match="verified must be"):
        round_handover_triton(v_fast[:-1], *args())
    # with a host buffer (pinned on a GPU, written by the kernel itself): each request's rows and the accepted counts
    host = torch.full((N + R + 2 + 4,), -5, dtype=torch.long, pin_memory=DEV == "cuda")
    v_pub = torch.cat([top, torch.full((R + 2,), -7)]).to(DEV)
    assert all(torch.equal(a, b) for a, b in zip(round_handover_triton(v_pub, *args(), host=host), ref))
    if DEV == "cuda": torch.cuda.synchronize()
    rows = int((drafts + 1)[:R].sum())
    assert host[:rows].tolist() == v_ref[:rows].tolist() and host[N:N + R].tolist() == v_ref[N:N + R].tolist()
    assert (host[rows:N] == -5).all()                              # padding rows: untouched (padding requests write row 0)
    assert (host[N + R + 2:] == -5).all()                          # nothing past the accepted counts
    with pytest.raises(ValueError, match="host must be"):
        round_handover_triton(v_pub, *args(), host=host[:N])


@pytest.mark.parametrize("w,size", [(6, 11), (64, 69), (5, 5)])
def test_window_kernel_equals_the_rings_mask(w, size):
    "The context window's mask and completeness from the kernel and from `DraftContext.window`'s torch."
    from dspark.kernels.round import window_triton
    rings = torch.full((5, size), -1, dtype=torch.long)
    for r, top in enumerate((3 * size // 2 + 1, 2 * size + 3, 2, size)):   # ring 4 stays empty (the scratch ring)
        held = torch.arange(max(0, top - size), top)
        rings[r, held % size] = held
    rings[1, (2 * size + 1) % size] = -1                         # a hole two below ring 1's anchor: incomplete
    slots = torch.tensor([0, 1, 2, 3, 4, 0, 3])
    P = torch.stack([rings[s].max() + 1 for s in slots.tolist()]).clamp(min=0)
    P[5], P[6] = 0, max(0, int(P[6]) - 2)                        # no context yet; an anchor two places back
    pos, slots, P = rings.to(DEV), slots.to(DEV), P.to(DEV)
    valid = (pos[slots] >= (P - w).clamp(min=0)[:, None]) & (pos[slots] < P[:, None])
    ref = valid, valid.sum(-1) == P.clamp(max=w)
    fast = window_triton(pos, slots, P, w)
    for a, b in zip(fast, ref): assert a.dtype == torch.bool and torch.equal(a, b), (a, b)
    assert ref[1].any() and not ref[1].all()
    assert window_triton(pos, slots[:0], P[:0], w)[0].shape == (0, size)


def test_the_draft_step_masks_its_window_in_one_launch(tiny_ckpt):
    """`DSparkProposer.draft_tensors` with the window kernel set (as `graphs.fast_path` sets it) launches it once and
    no torch mask, with gradients on as when the graphs capture it, and drafts as without it."""
    from dspark.kernels.round import window_triton
    from dspark.spec.proposers import DSparkProposer
    target = dspark.load_target(tiny_ckpt, device=DEV)
    pr = DSparkProposer(load_drafter(tiny_ckpt, target), 2, DEV)
    pr.ctx.pos[0, :5] = torch.arange(5)
    slots, anchors, P = torch.tensor([0, 2], device=DEV), torch.tensor([3, 4], device=DEV), torch.tensor([5, 0], device=DEV)
    ref = pr.draft_tensors(slots, anchors, P, 3)
    pr.drafter.window_kernel = window_triton
    with torch.enable_grad():
        fast = pr.draft_tensors(slots, anchors, P, 3)
        launches = aten_launches(pr._window, slots, P)
    assert all(torch.equal(a, b) for a, b in zip(fast, ref)) and ref[2].tolist() == [True, True]
    assert launches == {"triton:_window_kernel": 1}, launches                  # no torch mask beside it


def test_context_rows_with_the_fused_kernel(tiny_ckpt):
    "A step's drafter context rows, written into the rings by the fused norm + RoPE kernel, equal the torch path's."
    from dspark.kernels.fused import qkv_rope_insert_
    from dspark.spec.proposers import DraftContext
    target = dspark.load_target(tiny_ckpt, device=DEV)
    drafter = load_drafter(tiny_ckpt, target)
    cfg, gen = target.cfg, torch.Generator().manual_seed(3)
    feats = torch.randn(9, len(cfg.dspark_target_layer_ids) * cfg.hidden_size, generator=gen).to(DEV)
    positions = torch.tensor([0, 1, 2, 40, 41, 7, 300, 301, 5], device=DEV)
    slots = torch.tensor([0, 0, 0, 2, 2, 1, 3, 3, 4], device=DEV)        # slot 4: the scratch ring of 4 requests
    rings = []
    for kernel in (None, qkv_rope_insert_):
        drafter.rope_kernel = kernel
        ctx = DraftContext(drafter, 4, DEV)
        with torch.no_grad(): ctx.insert_many(slots, feats, positions)
        rings.append((ctx.rows.clone(), ctx.pos.clone()))
    (ref, ref_pos), (fast, fast_pos) = rings
    assert torch.equal(ref_pos, fast_pos) and ref.abs().sum() > 0
    assert torch.allclose(fast, ref, atol=1e-5), (fast - ref).abs().max()


def test_advance_kernel_equals_the_reference():
    """The next round's layout from the kernel and from `kernels.round.advance_layout`, on the random rounds of
    test_fused_round (which checks the reference against `fill_layout`), on the test's device."""
    from dspark.kernels.round import advance_layout
    from dspark.kernels.round import advance_layout_triton
    from test_fused_round import random_rounds
    for buf, _, n, _, _, accepted, following in random_rounds(24, seed=5):
        for name in ("packed", "window_tables"): setattr(buf, name, getattr(buf, name).to(DEV))
        before = buf.packed.clone()
        advance_layout(buf.packed, buf.window_tables, buf.block_size, accepted.to(DEV), following.to(DEV), n)
        want, _ = buf.packed.clone(), buf.packed.copy_(before)
        advance_layout_triton(buf.packed, buf.window_tables, buf.block_size, accepted.to(DEV), following.to(DEV), n)
        assert torch.equal(buf.packed, want) and not torch.equal(want, before)


@pytest.mark.parametrize("views,rank", [(False, 8), (True, 8), (False, 32)])   # rank 32: 16-row blocks
def test_masked_steps_of_a_padded_bucket_draft_as_buffers_of_their_own(views, rank):
    """The masked greedy loop on `MaskedSteps` kept for a bucket of 4 rows (as `DraftGraphs` keeps them, over its
    captured step's outputs, each round's logits copied into its `U`) serving 2 requests, two rounds in a row: the
    drafts equal those of the loop on buffers of its own, and each is the best token its mask allows after the draft
    before it. `views`: the buffers written and read through numpy views made once, as the mapped (pinned) buffers
    are on a GPU; here the CPU tensors' own memory stands in for the mapping."""
    from dspark.kernels.markov import MaskedSteps, markov_masked_greedy_triton
    from dspark.model.drafter import markov_logits
    g = torch.Generator().manual_seed(3)
    B, R, K, V, D = 4, 2, 3, 300, 16
    U, h = torch.randn(B, K, V, generator=g).to(DEV), torch.randn(B, K, D, generator=g).to(DEV)
    w1, w2 = (torch.randn(V, rank, generator=g).to(DEV) for _ in range(2))
    anchors = torch.randint(0, V, (B,), generator=g).to(DEV)
    steps = MaskedSteps(torch.empty_like(U), h, anchors, w1, w2, K)     # a round's U is copied into its own
    if views:
        if DEV != "cpu": pytest.skip("numpy views of device buffers: the mapped path itself runs on the GPU")
        steps.np = {k: getattr(steps, k).numpy() for k in ("words", "prev", "vals", "idx")}
    for _ in range(2):
        U = torch.randn(B, K, V, generator=g).to(DEV); anchors.copy_(torch.randint(0, V, (B,), generator=g))
        words = [torch.randint(-2 ** 31, 2 ** 31 - 1, (R, (V + 31) // 32 + 2), generator=g, dtype=torch.int32).numpy()
                 for _ in range(K)]                     # two words more: a tokenizer larger than the model's vocabulary
        allowed = lambda k, last: words[k]
        got = markov_masked_greedy_triton(U[:R], h[:R], anchors[:R], w1, w2, K, allowed, None, steps).to(DEV)
        want = markov_masked_greedy_triton(U[:R], h[:R], anchors[:R], w1, w2, K, allowed).to(DEV)
        assert torch.equal(got, want) and got.shape == (R, K)
        for k in range(K):
            ok = torch.from_numpy((words[k][:, :, None] >> np.arange(32)) & 1).reshape(R, -1)[:, :V].bool().to(DEV)
            lg = markov_logits(U[:R, k], anchors[:R] if k == 0 else got[:, k - 1], w1, w2).masked_fill(~ok, float("-inf"))
            assert torch.equal(got[:, k], lg.argmax(-1))
