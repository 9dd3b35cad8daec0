"""Triton kernels (nbs/12_kernels_attention, nbs/13_kernels_fused) against their torch references.

On a machine without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set below before
anything imports triton; dspark.kernels_* would set it too), at small shapes; on a GPU machine they run compiled.
"""
import os

import torch

if not torch.cuda.is_available(): os.environ["TRITON_INTERPRET"] = "1"

import copy

import pytest

pytest.importorskip("triton")

import dspark.kernels.attention as ka
from dspark.kernels.attention import (batch_meta, indexer_scores, indexer_topk, indexer_topk_ref, sparse_attention,
                                      sparse_attention_ref)
from dspark.kernels.fused import attend_batch, qkv_rope_insert_, qkv_rope_insert_ref
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, attend_cached, forward_cached
from dspark.config import preset
from dspark.model.layers import apply_rope, rope_cos_sin, rope_inv_freq

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5   # fp32 max abs error (observed ~1e-6)
FP8_TOL = 2e-3   # an FP8 cache: a stored value one code step off moves outputs by up to ~4e-4 (observed)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads(); torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _random_topk(meta, r, g, k=5):
    "Up to `k` random visible compressed entries per token (-1 padded): an indexer selection to attend over."
    idx = torch.full((len(meta.tok_pos), k), -1, dtype=torch.int32)
    for t, p in enumerate(meta.tok_pos.tolist()):
        c = torch.randperm(max(p + 1, 0) // r, generator=g)[:k]
        idx[t, :len(c)] = c.int()
    return idx.to(DEV)

def _batch(specs, bs=16, pad=3, seed=0):
    "Shuffled block tables for requests `specs = [(start, n)]`, flattened and padded."
    g = torch.Generator().manual_seed(seed)
    nblk = [(s + n + bs - 1) // bs for s, n in specs]
    wp, cp = torch.randperm(sum(nblk) + 2, generator=g).tolist(), torch.randperm(sum(nblk) + 2, generator=g).tolist()
    seqs, a = [], 0
    for i, ((s, n), k) in enumerate(zip(specs, nblk)):
        seqs.append(SeqView(wp[a:a + k], cp[a:a + k], slot=i, start=s)); a += k
    return batch_meta(seqs, [n for _, n in specs], bs, pad_to=sum(n for _, n in specs) + pad, device=DEV), len(wp), g


def _rand(g, *shape): return torch.randn(*shape, generator=g).to(DEV)


@pytest.mark.parametrize("mode", ["sliding", "csa", "hca"])
def test_sparse_attention_matches_reference(mode):
    # decode deep in the context, verify of 4, prefill from 0 (fewer rows than the window), verify mid-block
    meta, nb, g = _batch([(37, 1), (50, 4), (0, 12), (29, 3)])
    H, d, r, w = 8, 64, 4, 16
    win, ent, q, sink = _rand(g, nb, 16, d), _rand(g, nb, 16 // r, d), _rand(g, len(meta.tok_pos), H, d), _rand(g, H)
    kw = {}
    if mode != "sliding": kw = dict(entries=ent, ratio=r)
    if mode == "csa":
        kw["topk_idx"] = _random_topk(meta, r, g)
    o = sparse_attention(q, win, sink, meta, w, d ** -0.5, **kw)
    assert (o - sparse_attention_ref(q, win, sink, meta, w, d ** -0.5, **kw)).abs().max() <= TOL
    assert o[-3:].abs().max() == 0                                    # padding tokens are inert
    one = batch_meta([SeqView(meta.window_tables[1].tolist(), meta.tables[1].tolist(), 0, 52)], [1], 16, device=DEV)
    kw1 = {**kw, "topk_idx": kw["topk_idx"][3:4]} if mode == "csa" else kw
    assert torch.equal(sparse_attention(q[3:4], win, sink, one, w, d ** -0.5, **kw1)[0], o[3])   # batch-independent
    bn = 8 if DEV == "cpu" else 16     # small tiles give each split several; tl.dot on a GPU wants K >= 16
    o2 = sparse_attention(q, win, sink, meta, w, d ** -0.5, splits=2, block_n=bn, **kw)   # flash-decoding splits
    assert (o2 - o).abs().max() <= TOL and o2[-3:].abs().max() == 0
    assert torch.equal(sparse_attention(q[3:4], win, sink, one, w, d ** -0.5, splits=2, block_n=bn, **kw1)[0], o2[3])
    o16 = sparse_attention(q[3:4], win, sink, one, w, d ** -0.5, splits=16, block_n=bn, **kw1)   # more splits than tiles
    assert (o16[0] - o[3]).abs().max() <= TOL
    with pytest.raises(ValueError, match="power of two"): sparse_attention(q, win, sink, meta, w, d ** -0.5, splits=3, **kw)


def test_sparse_attention_rejects_dtype_mismatch():
    meta, nb, g = _batch([(5, 1)])
    with pytest.raises(ValueError, match="same dtype"):
        sparse_attention(_rand(g, 4, 2, 16).double(), _rand(g, nb, 16, 16), _rand(g, 2), meta, 16, 0.25)


@pytest.mark.parametrize("data", ["random", "integer"])
def test_indexer_topk_matches_topk_stable(data, monkeypatch):
    meta, _, g = _batch([(37, 1), (50, 4), (0, 12), (70, 2)], pad=2, seed=1)
    HI, di, r, K, N = 4, 64, 4, 8, len(meta.tok_pos)
    nb = int(meta.tables.max()) + 1
    if data == "random":
        keys, q, w = _rand(g, nb, 16 // r, di), _rand(g, N, HI, di), _rand(g, N, HI)
    else:   # exact in fp32 (scale 64^-1/2 = 1/8): bit-identical scores, many exact ties at the cut
        keys = torch.randint(-1, 2, (nb, 16 // r, di), generator=g).float().to(DEV)
        q = torch.randint(-1, 2, (N, HI, di), generator=g).float().to(DEV)
        w = (torch.randint(-2, 3, (N, HI), generator=g).float() * 0.25).to(DEV)
    idx = indexer_topk(q, w, keys, meta, r, di ** -0.5, K)
    assert torch.equal(idx, indexer_topk_ref(q, w, keys, meta, r, di ** -0.5, K))
    monkeypatch.setattr(ka, "SORT_TOPK_COLS", 0)                     # long rows: torch.topk instead of the sort
    assert torch.equal(indexer_topk(q, w, keys, meta, r, di ** -0.5, K), idx)
    monkeypatch.undo()
    assert (idx[-2:] == -1).all() and (idx[5:8] == -1).all()          # padding; prefill positions 0..2 see nothing
    if data == "integer":                                             # the case under test: exact ties
        sc = indexer_scores(q, w, keys, meta, r, di ** -0.5)
        assert sum(len(v) - len(v.unique()) for v in (row[row > float("-inf")] for row in sc)) > 0
    for t in range(1, 5):   # verify tokens == the same tokens run alone as decode steps
        one = batch_meta([SeqView(meta.window_tables[1].tolist(), meta.tables[1].tolist(), 0, 49 + t)], [1], 16, device=DEV)
        assert torch.equal(indexer_topk(q[t:t + 1], w[t:t + 1], keys, one, r, di ** -0.5, K)[0], idx[t])


def test_qkv_rope_insert_matches_reference():
    g = torch.Generator().manual_seed(0)
    cos, sin = rope_cos_sin(rope_inv_freq(preset("tiny"), compressed=True), torch.tensor([3, 40, 41, 100, 0]))
    cos, sin = cos.to(DEV), sin.to(DEV)
    q, kv, w = _rand(g, 5, 4, 128), _rand(g, 5, 128), (torch.rand(128, generator=g) + 0.5).to(DEV)
    slots = torch.tensor([5, 17, -1, 100, 33], device=DEV)
    cache, cache_ref = torch.zeros(10, 16, 128, device=DEV), torch.zeros(10, 16, 128, device=DEV)
    q_ref, kv_ref = qkv_rope_insert_ref(q, cos, sin, 1e-6, kv, w, cache_ref, slots)
    qkv_rope_insert_(q, cos, sin, 1e-6, kv, w, cache, slots)
    for a, b in [(q, q_ref), (kv, kv_ref), (cache, cache_ref)]: assert (a - b).abs().max() <= TOL
    assert int((cache != 0).any(-1).sum()) == 4


def test_rope_inverse_into_bf16_matches_rotate_back_then_cast():
    """`inverse=True, out=` (the attention output's way back to its projection): the same values as rotating by
    `-sin` in place and casting afterwards, bit for bit in bf16, and q itself untouched; rotating forward then back
    returns the input. A wrong `out` is refused."""
    g = torch.Generator().manual_seed(1)
    cos, sin = rope_cos_sin(rope_inv_freq(preset("tiny"), compressed=False), torch.tensor([7, 0, 63, 2]))
    cos, sin = cos.to(DEV), sin.to(DEV)
    o = _rand(g, 4, 3, 128)
    before = o.clone()
    ob = torch.empty(o.shape, dtype=torch.bfloat16, device=DEV)
    got = qkv_rope_insert_(o, cos, sin, 1e-6, q_norm=False, inverse=True, out=ob)[0]
    assert got is ob and torch.equal(o, before)
    want = qkv_rope_insert_(o.clone(), cos, -sin, 1e-6, q_norm=False)[0].to(torch.bfloat16)
    assert torch.equal(ob, want)
    ref = qkv_rope_insert_ref(o, cos, sin, 1e-6, q_norm=False, inverse=True)[0]
    assert (ob.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    there = qkv_rope_insert_(o.clone(), cos, sin, 1e-6, q_norm=False)[0]
    back = qkv_rope_insert_(there, cos, sin, 1e-6, q_norm=False, inverse=True)[0]
    assert (back - before).abs().max() <= TOL
    with pytest.raises(ValueError, match="out must have q's shape"):
        qkv_rope_insert_(o, cos, sin, 1e-6, q_norm=False, inverse=True, out=ob[:2])


def _on_dev(model):
    "The shared CPU fixture, or a copy of it on the GPU (where Triton is compiled for CUDA tensors)."
    return model if DEV == "cpu" else copy.deepcopy(model).to(DEV)


def test_attend_batch_matches_attend_cached(tiny_model):
    tiny_model = _on_dev(tiny_model)
    cfg, g = tiny_model.cfg, torch.Generator().manual_seed(0)
    cache = PagedKVCache(cfg, CacheConfig(block_size=16, num_blocks=24, num_window_blocks=24, max_seqs=3, lookahead=8), device=DEV)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).to(DEV) for n in (30, 84, 8)]
    forward_cached(tiny_model, cache, prompts, [SeqView(t, t, i, 0) for i, t in enumerate(tables)])
    step = [SeqView(t, t, i, len(p)) for i, (t, p) in enumerate(zip(tables, prompts))]
    meta = batch_meta(step, [1, 4, 9], 16, pad_to=16, device=DEV)                 # decode, verify, prefill chunk, 2 padding
    x = torch.randn(16, cfg.hidden_size, generator=g).to(DEV)
    with torch.no_grad():
        for layer in (1, 2, 3):                                       # sliding, CSA (22 entries > top-16), HCA
            attn = tiny_model.layers[layer].attn
            fast_cache, ref_cache = copy.deepcopy(cache), copy.deepcopy(cache)
            out = attend_batch(attn, layer, x, step, meta, fast_cache)
            ref = torch.cat([attend_cached(attn, layer, x[None, a:e], s, ref_cache)[0]
                             for a, e, s in zip([0, 1, 5], [1, 5, 14], step)])
            assert (out[:14] - ref).abs().max() <= TOL, layer
            assert out[14:].abs().max() == 0
            assert (fast_cache.window[layer] - ref_cache.window[layer]).abs().max() <= TOL


@pytest.mark.parametrize("mode", ["sliding", "csa", "hca"])
def test_sparse_attention_reads_fp8_rows(mode):
    "FP8 rows (`kv_cache_dtype='fp8'`) are decoded in the kernel: it matches the reference on torch-dequantised rows."
    meta, nb, g = _batch([(37, 1), (50, 4), (0, 12), (29, 3)])
    cfg = preset("tiny")                                               # head_dim 128: 64 FP8 + 64 BF16 rope channels
    H, d, r, w = 4, cfg.head_dim, 4, 16
    cache = PagedKVCache(cfg, CacheConfig(block_size=16, num_blocks=nb, num_window_blocks=nb, max_seqs=1, fp8=True), DEV)
    spread = torch.logspace(-2, 1, d, device=DEV)                      # channels of different magnitudes, some subnormal
    cache.write(cache.window[0], torch.arange(nb).repeat_interleave(16), torch.arange(16).repeat(nb), _rand(g, nb * 16, d) * spread)
    cache.write(cache.entries[2], torch.arange(nb).repeat_interleave(4), torch.arange(4).repeat(nb), _rand(g, nb * 4, d))
    (wd, ws), (ed, es) = cache.packed(cache.window[0]), cache.packed(cache.entries[2])
    q, sink = _rand(g, len(meta.tok_pos), H, d), _rand(g, H)
    kw = dict(window_scales=ws, rope_dim=cfg.qk_rope_head_dim)
    if mode != "sliding": kw.update(entries=ed, entry_scales=es, ratio=r)
    if mode == "csa":
        kw["topk_idx"] = _random_topk(meta, r, g)
    o = sparse_attention(q, wd, sink, meta, w, d ** -0.5, **kw)
    ref = sparse_attention_ref(q, wd, sink, meta, w, d ** -0.5, **kw)
    assert (o - ref).abs().max() <= TOL * ref.abs().max().clamp_min(1)   # rows up to ~10: fp32 rounding, relative
    assert o[-3:].abs().max() == 0
    with pytest.raises(ValueError, match="FP8 rows"):
        sparse_attention(q.half(), wd, sink, meta, w, d ** -0.5, **kw)


def test_indexer_reads_mxfp4_keys():
    "MXFP4 keys are decoded in the kernel: identical selections to the reference on torch-dequantised keys."
    from dspark.model.quant import fake_quant_index
    meta, _, g = _batch([(37, 1), (50, 4), (0, 12), (70, 2)], pad=2, seed=1)
    cfg = preset("tiny")
    HI, di, r, K, N = 4, cfg.index_head_dim, 4, 8, len(meta.tok_pos)
    nb = int(meta.tables.max()) + 1
    cache = PagedKVCache(cfg, CacheConfig(block_size=16, num_blocks=nb, num_window_blocks=1, max_seqs=1, fp8=True), DEV)
    cache.write(cache.index_keys[2], torch.arange(nb).repeat_interleave(4), torch.arange(4).repeat(nb),
                fake_quant_index(_rand(g, nb * 4, di)), index=True)
    keys, ksc = cache.packed(cache.index_keys[2], index=True)
    q, w = fake_quant_index(_rand(g, N, HI, di)), _rand(g, N, HI)
    idx = indexer_topk(q, w, keys, meta, r, di ** -0.5, K, key_scales=ksc)
    assert torch.equal(idx, indexer_topk_ref(q, w, keys, meta, r, di ** -0.5, K, key_scales=ksc))
    from dspark.model.quant import dequantize_index_rows
    plain = indexer_scores(q, w, dequantize_index_rows(keys, ksc), meta, r, di ** -0.5)
    assert torch.equal(indexer_scores(q, w, keys, meta, r, di ** -0.5, key_scales=ksc), plain)   # exact decode


def test_attend_batch_on_an_fp8_cache(tiny_model):
    "The batched layer on an FP8 cache (kernel-decoded rows and keys) against `attend_cached` on a copy of it."
    tiny_model = _on_dev(tiny_model)
    cfg, g = tiny_model.cfg, torch.Generator().manual_seed(0)
    cache = PagedKVCache(cfg, CacheConfig(block_size=16, num_blocks=24, num_window_blocks=24, max_seqs=3, lookahead=8, fp8=True), device=DEV)
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(3)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).to(DEV) for n in (30, 84, 8)]
    forward_cached(tiny_model, cache, prompts, [SeqView(t, t, i, 0) for i, t in enumerate(tables)])
    step = [SeqView(t, t, i, len(p)) for i, (t, p) in enumerate(zip(tables, prompts))]
    meta = batch_meta(step, [1, 4, 9], 16, pad_to=16, device=DEV)
    x = torch.randn(16, cfg.hidden_size, generator=g).to(DEV)
    with torch.no_grad():
        for layer in (1, 2, 3):
            attn = tiny_model.layers[layer].attn
            fast_cache, ref_cache = copy.deepcopy(cache), copy.deepcopy(cache)
            out = attend_batch(attn, layer, x, step, meta, fast_cache)
            ref = torch.cat([attend_cached(attn, layer, x[None, a:e], s, ref_cache)[0]
                             for a, e, s in zip([0, 1, 5], [1, 5, 14], step)])
            # The rows the step inserts are computed in another order than the reference's, and now and then a value on
            # an FP8 rounding boundary is stored one code step away (2^-4 of itself; which values, depends on the
            # CPU's GEMM kernels): its bytes differ in a few places and the outputs that read it by ~1e-4.
            assert (out[:14] - ref).abs().max() <= FP8_TOL, layer
            assert out[14:].abs().max() == 0
            moved = (fast_cache.window[layer] != ref_cache.window[layer]).sum()
            assert moved <= 4, (layer, moved)                   # the same bytes but a few (1 of 80,000 observed)


@pytest.mark.parametrize("pooled", [0, 32])
def test_attend_batch_prefills_an_fp8_cache(tiny_model, pooled):
    """Prefill chunks longer than every compressor ring, on an FP8 cache: the batched layer quantises its entries
    through `store_entries` (chapter 15's kernel writes them to rows first). Then a decode step reads what each
    cache holds. `pooled`: the requests resume a cached prefix there (its entries already stored, left alone)."""
    tiny_model = _on_dev(tiny_model)
    cfg, g = tiny_model.cfg, torch.Generator().manual_seed(1)
    cache = PagedKVCache(cfg, CacheConfig(block_size=16, num_blocks=24, num_window_blocks=24, max_seqs=2, lookahead=4, fp8=True), device=DEV)
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(2)]
    lens = [70, 45]
    x = torch.randn(sum(lens) + 2, cfg.hidden_size, generator=g).to(DEV)
    with torch.no_grad():
        for layer in (2, 3):                                            # CSA (ratio 4), HCA (ratio 16)
            attn = tiny_model.layers[layer].attn
            fast, ref = copy.deepcopy(cache), copy.deepcopy(cache)
            if pooled:                                                  # the cached prefix: stored by the reference
                for c in (fast, ref):
                    for i, t in enumerate(tables):
                        attend_cached(attn, layer, x[None, :pooled], SeqView(t, t, i, 0), c)
            starts = [pooled - 4 if pooled else 0] * 2                  # a hit resumes 4 positions early
            step = [SeqView(t, t, i, s, pooled) for i, (t, s) in enumerate(zip(tables, starts))]
            n = [L - s for L, s in zip(lens, starts)]
            meta = batch_meta(step, n, 16, pad_to=sum(n) + 2, device=DEV)
            xs = x[:sum(n) + 2]
            out = attend_batch(attn, layer, xs, step, meta, fast)
            bounds = [0, n[0], n[0] + n[1]]
            want = torch.cat([attend_cached(attn, layer, xs[None, a:e], sq, ref)[0] for a, e, sq in zip(bounds, bounds[1:], step)])
            assert (out[:sum(n)] - want).abs().max() <= 20 * TOL, layer
            nxt = [SeqView(t, t, i, L, pooled) for i, (t, L) in enumerate(zip(tables, lens))]   # one decode token each
            meta = batch_meta(nxt, [1, 1], 16, device=DEV)
            out = attend_batch(attn, layer, x[:2], nxt, meta, fast)
            want = torch.cat([attend_cached(attn, layer, x[None, i:i + 1], sq, ref)[0] for i, sq in enumerate(nxt)])
            assert (out - want).abs().max() <= 20 * TOL, layer


def test_llm_on_the_batched_triton_forward_matches_the_reference(tmp_path):
    """End to end through `LLM`: the batched Triton forward (`attention_backend="triton"`) gives the same greedy
    tokens and the same accepted drafts as the reference per-request forward, with DSpark drafting (so verify
    blocks, prefill chunks and decode tokens share steps)."""
    import dspark
    ck = dspark.make_tiny_checkpoint(tmp_path / "ck", seed=3, drafter="dspark")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (5, 12, 30)]
    sp = dspark.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    kw = dict(speculative="dspark", num_speculative_tokens=3, max_num_seqs=4, kv_cache_memory_bytes=16 * 2**20,
              max_num_batched_tokens=64, device=DEV)                # on a GPU: CUDA graphs and fused rounds too
    runs = {}
    for backend in ("reference", "triton"):
        llm = dspark.LLM(ck, attention_backend=backend, **kw)
        runs[backend] = ([o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)], llm.spec_stats())
    assert runs["triton"] == runs["reference"]
    assert runs["reference"][1]["num_drafts"] > 0


def test_attention_backend_is_checked(tmp_path):
    import dspark
    ck = dspark.make_tiny_checkpoint(tmp_path / "ck", seed=0, drafter=None)
    with pytest.raises(ValueError, match="attention_backend"):
        dspark.LLM(ck, attention_backend="flash", kv_cache_memory_bytes=16 * 2**20)



@pytest.mark.parametrize("src,dst", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                     (torch.float32, torch.float32)])
def test_attention_output_rotates_back_into_its_dtype_as_rotating_then_casting(src, dst):
    """`Attention.output` (the inverse RoPE at prefill, cast into the projection's dtype once): bit for bit the
    projection of `apply_rope(o, cos, -sin).to(dtype)`, with `o` untouched."""
    from dspark.model.attention import Attention
    cfg = preset("tiny")
    torch.manual_seed(2)
    attn = Attention(cfg, 0).to(dst)
    cos, sin = rope_cos_sin(rope_inv_freq(cfg, compressed=False), torch.tensor([[5, 0, 40]]))
    o = torch.randn(1, 3, cfg.num_attention_heads, cfg.head_dim).to(src)
    before = o.clone()
    got = attn.output(o, cos, sin, dst)
    want = attn.project_out(apply_rope(o, cos.unsqueeze(-2), -sin.unsqueeze(-2)).to(dst))
    assert got.dtype == dst and torch.equal(got, want) and torch.equal(o, before)
