"""Training code (dspark.tools.corpus, train_model, train): train/inference parity of the drafters, loss decreases, shipping layout,
and the model that ships inside the package."""
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import dspark
from dspark.tools import corpus as C, train as T, train_model as M
from dspark.model.checkpoint import train_tokenizer, tiny_corpus
from dspark.model.drafter import load_drafter
from dspark.model.transformer import Transformer
from dspark.model.mtp import MTPDrafter, MTPRing
from dspark.spec.proposers import DraftContext

SMALL = dict(vocab_size=512, hidden_size=64, index_topk=4, moe_intermediate_size=32, sliding_window=16)


def test_split_is_a_function_of_the_path():
    files = C.corpus_files()
    train, held = C.split_files(files)
    assert sorted(train + held) == files and not set(train) & set(held)
    assert 0.02 < len(held) / len(files) < 0.08
    assert [C.is_heldout(f) for f in held] == [True] * len(held)
    assert C.is_heldout("bisect.py") and not C.is_heldout("os.py")


def test_target_training_forward_is_the_model():
    torch.manual_seed(0)
    tgt = M.init_weights(Transformer(M.model_config(**SMALL)), seed=0)
    ids = torch.randint(5, 512, (2, 70))
    x, taps, kl = M.target_forward(tgt, ids, taps=(3, 5), indexer_loss=True)
    torch.testing.assert_close(M.final_logits(tgt, x), tgt.logits(ids), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(taps[3], tgt(ids, taps=(3,))[1][3])
    kl.backward()                                       # the indexer KL reaches the indexer and nothing else
    grads = {n for n, p in tgt.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert grads and all(".indexer." in n for n in grads)


def test_dspark_training_block_equals_engine_block(tiny_ckpt, tiny_model):
    "Training forward (many anchors, gathered context) == DraftContext + block_forward + markov, fp32."
    d = load_drafter(tiny_ckpt, tiny_model)
    ids = torch.randint(5, 512, (2, 110), generator=torch.Generator().manual_seed(1))
    _, taps = tiny_model(ids, taps=tuple(tiny_model.cfg.dspark_target_layer_ids))
    feats = d.features(taps)
    seq, P = torch.tensor([0, 0, 1, 1]), torch.tensor([1, 20, 64, 104])     # below, at and past the window
    lg, conf = M.dspark_block_train(d, ids, feats, seq, P)
    for n in range(len(P)):
        b, p = int(seq[n]), int(P[n])
        ring = DraftContext(d, 1, "cpu"); ring.claim(0, "r")
        ring.insert(0, feats[b, :p], torch.arange(p))
        h = d.block_forward(int(ids[b, p]), p, ring.gather(0, p))
        ref, cf = d.markov(d.base_logits(h), h, ids[b, p:p + d.block_size])
        torch.testing.assert_close(lg[n], ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(conf[n], cf, rtol=1e-4, atol=1e-4)
    # a causal mask or a shifted anchor would break it: the anchor's own slot must see the whole block
    lg2, _ = M.dspark_block_train(d, ids, feats, seq[:1], P[:1] + 1)
    assert not torch.allclose(lg2[0], lg[0])


def test_mtp_training_rows_equal_engine_steps():
    cfg = M.model_config(**SMALL)
    tgt = M.init_weights(Transformer(cfg), seed=0).eval()
    m = M.init_weights(MTPDrafter(M.mtp_config(cfg), tgt), seed=1).eval()
    ids = torch.randint(5, 512, (1, 60), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        x, _, _ = M.target_forward(tgt, ids)
        rows = M.mtp_train_logits(m, ids, x)
        ring = MTPRing(m.cfg, 1, 4, torch.float32, "cpu"); ring.claim(0, "r")
        a = m.step(x[0, :30], ids[0, 1:31], torch.arange(30), ring, 0)[0]
        b = m.step(x[0, 30:59], ids[0, 31:60], torch.arange(30, 59), ring, 0)[0]
    torch.testing.assert_close(rows[0], torch.cat([a, b]), rtol=1e-4, atol=1e-4)


def test_block_loss_oracles():
    "L1 term is 2·TV, c* = 1 − TV, weights exp(−(k−1)/4), a draft equal to the target has zero TV."
    torch.manual_seed(0)
    lg, t = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
    labels, mask = torch.randint(0, 8, (3, 5)), torch.ones(3, 5)
    _, met = M.block_loss(lg, torch.zeros(3, 5), labels, t, mask)
    tv = (lg.softmax(-1) - t.softmax(-1)).abs().sum(-1)
    w = torch.exp(-torch.arange(5) / 4.0).expand(3, 5)
    torch.testing.assert_close(met["tv"], (tv * w).sum() / w.sum())
    _, same = M.block_loss(t, torch.zeros(3, 5), labels, t, mask)
    assert same["tv"] < 1e-6


@pytest.fixture(scope="module")
def tiny_trained():
    "A small target and its drafters after a few CPU steps each, with their loss histories."
    torch.manual_seed(0)
    tok = train_tokenizer([tiny_corpus()], 512)
    stream = C.encode_stream(tok, [tiny_corpus()] * 4)
    cfg = M.model_config(**SMALL)
    tgt = M.init_weights(Transformer(cfg), seed=0)
    h_t = M.train_target(tgt, stream, batch=4, seq_len=64, seed=0, steps=16, lr=3e-3, log_every=4)
    tgt.requires_grad_(False).eval()
    g = torch.Generator().manual_seed(0)
    data = [M.distill_batch(tgt, stream, 8, 24, 16, 0.0, g)]
    d = M.init_weights(dspark.model.drafter.DSparkDrafter(cfg, tgt), seed=1)
    h_d = M.train_dspark(d, data, seqs=8, anchors=8, seed=0, steps=16, lr=3e-3, log_every=4)
    m = M.init_weights(MTPDrafter(M.mtp_config(cfg), tgt), seed=2)
    h_m = M.train_mtp(m, data, seqs=8, seed=0, steps=16, lr=3e-3, log_every=4)
    return tok, tgt, d, m, h_t, h_d, h_m


def test_cpu_training_reduces_losses(tiny_trained):
    *_, h_t, h_d, h_m = tiny_trained
    for h in (h_t, h_d, h_m): assert h[-1]["loss"] < h[0]["loss"] - 0.2, [r["loss"] for r in h]
    assert h_d[-1]["acc"][0] > h_d[0]["acc"][0]


def test_saved_model_serves_both_drafters(tiny_trained, tmp_path):
    tok, tgt, d, m, *_ = tiny_trained
    out = T.save_model(tmp_path / "default", tgt, d, m, tok)
    sp = dspark.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [[0] + tok.encode("def f(x):").ids[1:]]
    base = dspark.LLM(model=out).generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    ds = dspark.LLM(model=out, speculative="dspark", num_speculative_tokens=5)
    assert ds.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == base
    mt = dspark.LLM(model=out / "mtp", speculative="mtp", num_speculative_tokens=2)
    assert mt.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids == base
    assert ds.spec_stats()["num_drafts"] > 0 and mt.spec_stats()["num_drafts"] > 0


SHIPPED = Path(dspark.__file__).parent / "models" / "default"


@pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="no shipped model")
def test_shipped_model():
    files = [f for f in SHIPPED.rglob("*") if f.is_file()]
    assert sum(f.stat().st_size for f in files) <= 30e6
    prov = json.loads((SHIPPED / "PROVENANCE.json").read_text())
    for k in ("command", "seed", "versions", "corpus", "phases", "eval"): assert k in prov
    hist = json.loads((SHIPPED / "history.json").read_text())
    assert all(hist[k] for k in ("target", "dspark", "mtp"))
    llm = dspark.LLM(model=SHIPPED, speculative="dspark", num_speculative_tokens=5)
    out = llm.generate(["import os\n\n\ndef "], dspark.SamplingParams(temperature=0.0, max_tokens=48), use_tqdm=False)
    text = out[0].outputs[0].text
    assert "(" in text and ":" in text, text                  # looks like Python
    st = llm.spec_stats()
    assert 1 + st["num_accepted_tokens"] / st["num_drafts"] > 2.0, st
