"""DSpark drafter: equation conformance against an independent naive implementation, and mutation tests
(reference dspark.md §8.1, §8.2, §8.4, §8.5)."""
import math

import pytest
import torch

import dspark
import dspark.model.drafter as D
from dspark.model.layers import hc_head, hc_post, hc_pre
from dspark.sample.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
T_CTX, ANCHOR = 45, 23


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    target = dspark.load_target(tiny_ckpt)
    drafter = D.load_drafter(tiny_ckpt, target)
    ids = torch.randint(0, 512, (1, T_CTX), generator=torch.Generator().manual_seed(4))
    _, taps = target(ids, taps=tuple(target.cfg.dspark_target_layer_ids))
    return target, drafter, taps


# ------------------------------------------------------------------ an independent, naive implementation
def _rms(x, w, eps=1e-6):
    x = x.double()
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.double()


def _rope(x, pos, inv):
    "Rotate the trailing pairs of x [n, d] by pos [n] with complex arithmetic."
    r = 2 * inv.numel()
    c = torch.view_as_complex(x[..., -r:].double().reshape(*x.shape[:-1], -1, 2).contiguous())
    ang = pos.double()[:, None] * inv.double()[None]
    turn = torch.polar(torch.ones_like(ang), ang)
    if x.dim() == 3: turn = turn.unsqueeze(-2)                       # one rotation per position, all heads
    return torch.cat([x[..., :-r].double(), torch.view_as_real(c * turn).flatten(-2)], -1)


def _naive_attention(st, y, pos, ctx_rows, cfg):
    "Block attention written out per head: every block query sees all context rows and all block rows."
    a, inv = st.attn, st.attn.inv_freq
    H, d = cfg.num_attention_heads, cfg.head_dim
    qr = _rms(y @ a.wq_a.weight.double().T, a.q_norm.weight)
    q = (qr @ a.wq_b.weight.double().T).view(-1, H, d)
    q = _rope(_rms(q, None), pos, inv)
    kv = _rope(_rms(y @ a.wkv.weight.double().T, a.kv_norm.weight), pos, inv)
    keys = torch.cat([ctx_rows.double(), kv], 0)
    out = torch.zeros(len(pos), H, d, dtype=torch.float64)
    for h in range(H):
        for t in range(len(pos)):
            logits = keys @ q[t, h] / math.sqrt(d)
            m = torch.maximum(logits.max(), a.attn_sink[h].double())
            w = torch.exp(logits - m)
            out[t, h] = (w[:, None] * keys).sum(0) / (w.sum() + torch.exp(a.attn_sink[h].double() - m))
    out = _rope(out, -pos, inv)                                       # inverse RoPE at the query position
    g = cfg.o_groups
    o = out.reshape(len(pos), g, -1)
    wa = a.wo_a.weight.double().view(g, cfg.o_lora_rank, -1)
    z = torch.stack([o[:, i] @ wa[i].T for i in range(g)], 1).flatten(1)
    return z @ a.wo_b.weight.double().T


@torch.no_grad()
def naive_draft(target, drafter, taps, anchor, P):
    cfg, g = target.cfg, cfg_block(target)
    st0, last = drafter.mtp[0], drafter.mtp[-1]
    F = torch.cat([taps[l][0] for l in cfg.dspark_target_layer_ids], -1).double()      # configured order
    main_x = _rms(F @ st0.main_proj.weight.double().T, st0.main_norm.weight)
    ctx_pos = torch.arange(F.shape[0])
    pos = torch.arange(P, P + g)
    ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (g - 1))
    x = target.embed.weight.double()[ids][:, None, :].repeat(1, cfg.hc_mult, 1)
    for st in drafter.mtp:
        ctx_rows = _rope(_rms(main_x @ st.attn.wkv.weight.double().T, st.attn.kv_norm.weight), ctx_pos, st.attn.inv_freq)
        y, post, comb = hc_pre(x.float(), *st.site("attn"), cfg)
        att = _naive_attention(st, _rms(y, st.attn_norm.weight), pos, ctx_rows, cfg)
        x = hc_post(att.float(), x.float(), post, comb)
        y, post, comb = hc_pre(x, *st.site("ffn"), cfg)
        x = hc_post(st.ffn(st.ffn_norm(y)), x, post, comb)
    h = hc_head(x, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, cfg).double()
    U = _rms(h, last.norm.weight) @ target.head.weight.double().T
    W1, W2, wc = last.markov_head.markov_w1.weight.double(), last.markov_head.markov_w2.weight.double(), last.confidence_head.proj.weight.double()[0]
    prev, toks, logits, surv, alive = anchor, [], [], [], 1.0
    for k in range(g):
        lk = U[k] + W2 @ W1[prev]
        c = 1 / (1 + math.exp(-float(wc @ torch.cat([h[k], W1[prev]]))))
        alive *= c
        prev = int(lk.argmax()); toks.append(prev); logits.append(lk); surv.append(alive)
    return toks, torch.stack(logits), torch.tensor(surv, dtype=torch.float64)


def cfg_block(target):
    return target.cfg.dspark_block_size


def _backbone(drafter, taps, anchor, P):
    "Context rows from the tapped features, then the block's hidden states and base logits."
    feats = drafter.features(taps)[0]
    ctx = drafter.context_kv(feats, torch.arange(feats.shape[0]))
    h = drafter.block_forward(anchor, P, ctx)
    return ctx, h, drafter.base_logits(h)


@torch.no_grad()
def ours(drafter, taps, anchor, P):
    _, h, U = _backbone(drafter, taps, anchor, P)
    toks, q, conf = drafter.markov_sample(U, h, anchor, GREEDY, 0, P)
    lg, conf_tf = drafter.markov(U, h, torch.tensor(D.markov_prev(anchor, toks)))
    return toks, lg, D.survival(conf_tf)


def conforms(setup):
    target, drafter, taps = setup
    a = ours(drafter, taps, ANCHOR, T_CTX)
    b = naive_draft(target, drafter, taps, ANCHOR, T_CTX)
    return a[0] == b[0] and torch.allclose(a[1].double(), b[1], atol=1e-3, rtol=1e-4) and torch.allclose(a[2].double(), b[2], atol=1e-5)


# ------------------------------------------------------------------ tests
def test_conformance(setup):
    assert conforms(setup)


def _causal_sink_attention(q, keys, mask, sink, scale):
    g = q.shape[1]
    causal = torch.ones_like(mask)
    causal[..., -g:] = torch.tril(torch.ones(g, g, dtype=torch.bool))
    return D.__dict__["_orig_sink"](q, keys, mask & causal, sink, scale)


MUTATIONS = {
    "causal block mask": lambda mp: (setattr(D, "_orig_sink", D.sink_attention), mp.setattr(D, "sink_attention", _causal_sink_attention)),
    "no Markov bias": lambda mp: mp.setattr(D.DSparkDrafter, "markov", lambda self, U, h, prev: (U, D.DSparkDrafter._markov(self, U, h, prev)[1])),
    "x_k instead of x_(k-1)": lambda mp: mp.setattr(D, "markov_prev", lambda anchor, drafts: list(drafts)),
    "reversed target layers": lambda mp: mp.setattr(D.DSparkDrafter, "features", lambda self, taps: torch.cat([taps[l] for l in reversed(self.cfg.dspark_target_layer_ids)], -1)),
    "current token into confidence": lambda mp: mp.setattr(D.DSparkDrafter, "markov", lambda self, U, h, prev: (
        D.DSparkDrafter._markov(self, U, h, prev)[0],
        D.DSparkDrafter._markov(self, U, h, D.DSparkDrafter._markov(self, U, h, prev)[0].argmax(-1))[1])),
    "no sigmoid": lambda mp: mp.setattr(D, "survival", lambda z: z.float().cumprod(-1)),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_each_mutation_breaks_conformance(setup, monkeypatch, name):
    monkeypatch.setattr(D.DSparkDrafter, "_markov", D.DSparkDrafter.markov, raising=False)
    MUTATIONS[name](monkeypatch)
    assert not conforms(setup), f"the conformance test did not notice: {name}"


def test_markov_sampling_equals_teacher_forced_scoring(setup):
    "§8.5 for sampled drafts too: q_k is softmax of the teacher-forced corrected logits."
    target, drafter, taps = setup
    _, h, U = _backbone(drafter, taps, ANCHOR, T_CTX)
    sp = SamplingParams(temperature=0.8, top_k=50)
    toks, q, conf = drafter.markov_sample(U, h, ANCHOR, sp, 9, T_CTX)
    lg, conf_tf = drafter.markov(U, h, torch.tensor(D.markov_prev(ANCHOR, toks)))
    from dspark.sample.sampling import process_logits
    torch.testing.assert_close(q, process_logits(lg, 0.8, 50).softmax(-1))
    torch.testing.assert_close(conf, conf_tf)


def test_block_invariance(setup):
    "§8.4: the backbone depends on anchor, context and positions only; sampled drafts change only the Markov bias."
    target, drafter, taps = setup
    ctx, h, U = _backbone(drafter, taps, ANCHOR, T_CTX)
    a = drafter.markov_sample(U, h, ANCHOR, SamplingParams(temperature=1.0), 1, T_CTX)[0]
    b = drafter.markov_sample(U, h, ANCHOR, SamplingParams(temperature=1.0), 2, T_CTX)[0]
    assert a != b
    torch.testing.assert_close(drafter.block_forward(ANCHOR, T_CTX, ctx), h)
    lg1, _ = drafter.markov(U, h, torch.tensor(D.markov_prev(ANCHOR, a)))
    lg2, _ = drafter.markov(U, h, torch.tensor(D.markov_prev(ANCHOR, b)))
    assert not torch.allclose(lg1, lg2)
    bias = drafter.last.markov_head.markov_w2(drafter.last.markov_head.markov_w1(torch.tensor(D.markov_prev(ANCHOR, a)))).float()
    torch.testing.assert_close(lg1 - bias, U)


def test_checkpoint_without_drafter_is_refused(tmp_path):
    ck = dspark.make_tiny_checkpoint(tmp_path / "plain", drafter=None)
    with pytest.raises(ValueError, match="DSpark"):
        D.load_drafter(ck, dspark.load_target(ck))


def test_missing_confidence_head_is_refused(tiny_ckpt, tmp_path):
    from dspark.model.checkpoint import CheckpointError, read_tensors, save_checkpoint
    raw = read_tensors(tiny_ckpt)
    last = tiny_ckpt and max(int(k.split(".")[1]) for k in raw if k.startswith("mtp."))
    raw.pop(f"mtp.{last}.confidence_head.proj.weight")
    bad = save_checkpoint(raw, dspark.load_config(tiny_ckpt), tmp_path / "bad")
    with pytest.raises(CheckpointError, match="confidence_head"):
        D.load_drafter(bad, dspark.load_target(tiny_ckpt))


def test_renamed_markov_keys_load(tiny_ckpt, tmp_path):
    "V4.1 names the Markov tensors markov_head.embed / markov_head.head: same math, other names."
    from dspark.model.checkpoint import read_tensors, save_checkpoint
    raw = {k.replace("markov_w1", "embed").replace("markov_w2", "head"): v for k, v in read_tensors(tiny_ckpt).items()}
    alt = save_checkpoint(raw, dspark.load_config(tiny_ckpt), tmp_path / "alt")
    t = dspark.load_target(tiny_ckpt)
    a, b = D.load_drafter(tiny_ckpt, t), D.load_drafter(alt, t)
    torch.testing.assert_close(a.last.markov_head.markov_w2.weight, b.last.markov_head.markov_w2.weight)


def test_block_rope_angles_once_per_table():
    "The embedded drafter's two stages share one RoPE table: a block computes its cos/sin once, not once a stage."
    from dspark.model.checkpoint import DEFAULT_MODEL
    from dspark.kernels.hc import aten_launches
    drafter = D.load_drafter(DEFAULT_MODEL, dspark.load_target(DEFAULT_MODEL, device="cpu"))
    assert len(drafter.mtp) == 2 and len({st.attn.kind for st in drafter.mtp}) == 1
    n = drafter.cfg.sliding_window + drafter.block_size
    rows = torch.randn(2, 2, n, drafter.cfg.head_dim)
    with torch.no_grad():
        ops = aten_launches(drafter.block_hidden, torch.tensor([3, 4]), torch.tensor([5, 9]), rows, torch.ones(2, n, dtype=torch.bool))
    assert ops["cos"] == ops["sin"] == 1, ops
