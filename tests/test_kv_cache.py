"""The paged cache and the incremental forward reproduce the full causal forward exactly (fp32)."""
import pytest
import torch

from dspark.config import preset
from dspark.cache.kv_cache import CacheConfig, PagedKVCache, SeqView, forward_cached, kv_bytes_per_token

N = 150


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 512, (N,), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def full(tiny_model, ids):
    return tiny_model.logits(ids[None])[0]


WIN = [4, 0, 6, 2, 7, 1]      # window-group blocks, deliberately not in order


def _cache(model, lookahead=0, seqs=2):
    cc = CacheConfig(block_size=32, num_blocks=24, num_window_blocks=12, max_seqs=seqs, lookahead=lookahead)
    return PagedKVCache(model.cfg, cc)


def _run(model, ids, sizes, cache=None, table=(5, 0, 7, 2, 9, 1), slot=0):
    cache = cache or _cache(model)
    out, s = [], 0
    for n in sizes:
        out.append(forward_cached(model, cache, [ids[s:s + n]], [SeqView(WIN, list(table), slot, s)])[0]); s += n
    return torch.cat(out)


def _close(a, b):
    assert (a - b).abs().max() <= 1e-4 * b.abs().max(), (a - b).abs().max()


@pytest.mark.parametrize("split", [37, 101])   # not on window (64) or ratio (4, 16) boundaries; chunk=1 covers decode from 0
def test_prefill_then_decode(tiny_model, ids, full, split):
    _close(_run(tiny_model, ids, [split] + [1] * (N - split)), full)


@pytest.mark.parametrize("chunk", [1, 3, 17, 64])
def test_chunked_prefill(tiny_model, ids, full, chunk):
    _close(_run(tiny_model, ids, [chunk] * (N // chunk) + ([N % chunk] if N % chunk else [])), full)


def test_ragged_batch_equals_each_alone(tiny_model):
    "Requests of different lengths in one call give the same logits as each alone (no padding anywhere)."
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (5, 70, 33, 130)]
    cache = PagedKVCache(tiny_model.cfg, CacheConfig(block_size=32, num_blocks=40, num_window_blocks=40, max_seqs=4))
    tables = [list(range(i * 5, i * 5 + 5)) for i in range(4)]
    wins = [list(range(39 - i * 5, 34 - i * 5, -1)) for i in range(4)]
    together = forward_cached(tiny_model, cache, prompts, [SeqView(w, t, i, 0) for i, (w, t) in enumerate(zip(wins, tables))])
    for p, got in zip(prompts, together):
        _close(got, tiny_model.logits(p[None])[0])
    # ...and one decode step for all four at once
    nxt = [torch.tensor([7]) for _ in prompts]
    step = forward_cached(tiny_model, cache, nxt, [SeqView(w, t, i, len(p)) for i, (w, t, p) in enumerate(zip(wins, tables, prompts))])
    for p, got in zip(prompts, step):
        _close(got, tiny_model.logits(torch.cat([p, torch.tensor([7])])[None])[0, -1:])


def test_rejected_tokens_leave_no_state(tiny_model, ids, full):
    """Speculative tokens written past the committed length and then rejected change nothing: the next
    step recomputes those positions and matches the full forward (rings sized with the lookahead)."""
    cache = _cache(tiny_model, lookahead=6)
    table = [5, 0, 7, 2, 9, 1]
    _run(tiny_model, ids, [62], cache, table)                                  # commit 62 tokens
    junk = torch.randint(0, 512, (6,), generator=torch.Generator().manual_seed(1))
    forward_cached(tiny_model, cache, [junk], [SeqView(WIN, table, 0, 62)])    # 6 drafts at 62..67, all rejected
    got = forward_cached(tiny_model, cache, [ids[62:N]], [SeqView(WIN, table, 0, 62)])[0]
    _close(got, full[62:])


@pytest.mark.parametrize("back", [4, 21, 64])
def test_prefix_resume_recomputes_the_overlap_window(tiny_model, ids, full, back):
    """A second request reusing the blocks of positions [0, 64) resumes `back` positions earlier with an
    empty ring and `pooled_upto=64`: its logits match the full forward (fail-closed reuse of the compressor
    state; `back` = 4 is the CSA overlap window, 64 the DSpark drafter's context window)."""
    cache = _cache(tiny_model, seqs=2)
    _run(tiny_model, ids, [100], cache)                                        # request A fills blocks 0..3
    table = [5, 0, 11, 12, 13]                                                 # B shares A's first two blocks
    win = [4, 0, 8, 9, 10]
    s = 64 - back
    got = forward_cached(tiny_model, cache, [ids[s:N]], [SeqView(win, table, 1, s, pooled_upto=64)])[0]
    _close(got, full[s:])


def test_plan_cache_from_budget(tiny_model):
    from dspark.cache.kv_cache import plan_cache, block_bytes
    cc = plan_cache(tiny_model.cfg, 8 * 2**20, block_size=32, max_seqs=4, max_batched_tokens=128)
    comp_b, win_b = block_bytes(tiny_model.cfg, 32, torch.float32)
    assert cc.num_blocks * comp_b + cc.num_window_blocks * win_b <= 8 * 2**20 and cc.num_blocks > 10
    with pytest.raises(ValueError, match="too small"):
        plan_cache(tiny_model.cfg, 2**16, block_size=32, max_seqs=4, max_batched_tokens=128)


def test_block_size_must_cover_ratios(tiny_model):
    with pytest.raises(ValueError, match="multiple"):
        PagedKVCache(tiny_model.cfg, CacheConfig(block_size=24))


def test_kv_bytes_per_token_medium_matches_reference_formula():
    "Reference §3.3: per token, CSA layers hold d/4 + d_I/4 elements, HCA layers d/128 (bf16: 2 bytes each)."
    m = preset("medium")
    csa = sum(m.layer_type(i) == "compressed_sparse_attention" for i in range(m.num_hidden_layers))
    hca = sum(m.layer_type(i) == "heavily_compressed_attention" for i in range(m.num_hidden_layers))
    assert (csa, hca) == (5, 5)
    assert kv_bytes_per_token(m, 2) == csa * (512 * 2 / 4 + 128 * 2 / 4) + hca * 512 * 2 / 128 == 1640


def test_greedy_decode_matches_transformers_generate(tiny_ckpt, tiny_model):
    "64 greedy tokens through the paged cache equal transformers' greedy `generate` (its own V4 cache)."
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()
    prompt = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(11))
    hf.generation_config.eos_token_id = None          # run all 64 steps without altering any logit
    with torch.no_grad():
        ref = hf.generate(prompt[None], max_new_tokens=64, do_sample=False)[0, 23:]
    assert len(ref) == 64
    cache, table = _cache(tiny_model), [3, 1, 4, 0]
    logits = forward_cached(tiny_model, cache, [prompt], [SeqView(WIN, table, 0, 0)])[0]
    out = []
    for _ in range(64):
        out.append(int(logits[-1].argmax()))
        logits = forward_cached(tiny_model, cache, [torch.tensor(out[-1:])], [SeqView(WIN, table, 0, 23 + len(out) - 1)])[0]
    assert out == ref.tolist()
