"""Tokenizer: round trips, the chat template, errors that name the file or message, and streaming
detokenisation that never emits a broken character and always adds up to the full decode."""
import json
import random
import shutil

import pytest

from dspark.model.checkpoint import BOS, EOS, save_tokenizer, tiny_corpus, train_tokenizer
from dspark.tokenizer import REPLACEMENT, IncrementalDetokenizer, Tokenizer

TEXTS = ["Crème brûlée, naïve café, Müller über Öl.", "中文分词很有意思，中文字符是三个字节。",
         "Emoji 😀😃🎉 in text 😀 and 👍🏽.", "Mixed: é中😀ü文🎉 end."]


@pytest.fixture(scope="module")
def tok(tiny_ckpt):
    return Tokenizer.from_dir(tiny_ckpt)


@pytest.fixture(scope="module")
def mtok(tmp_path_factory):
    "A byte-level BPE whose merges go mostly to ASCII: é and ü become whole tokens, emoji and CJK are split."
    path = tmp_path_factory.mktemp("multibyte")
    save_tokenizer(train_tokenizer([tiny_corpus()[:2000], *TEXTS], vocab_size=400), path, model_max_length=4096)
    return Tokenizer.from_dir(path)


@pytest.mark.parametrize("text", ["Simple is better than complex.", "", *TEXTS, "😀", "ü中"])
def test_round_trip_adds_bos_once(tok, mtok, text):
    for t in (tok, mtok):
        ids = t.encode(text)
        assert ids[0] == t.bos_token_id and ids.count(t.bos_token_id) == 1
        assert t.encode(text, add_special_tokens=False) == ids[1:]
        assert t.decode(ids) == text
        assert t.decode(ids, skip_special_tokens=False) == BOS + text


def test_special_tokens_and_vocab(tok):
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (BOS, 0, EOS, 1)
    assert tok.vocab_size == 512


def test_chat_template_renders_deepseek_format(tok):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": "why?"}]
    assert tok.apply_chat_template(chat[1:2]) == f"{BOS}<｜User｜>hi<｜Assistant｜>"
    assert tok.apply_chat_template(chat) == f"{BOS}Be brief.<｜User｜>hi<｜Assistant｜>hello{EOS}<｜User｜>why?<｜Assistant｜>"
    assert tok.apply_chat_template(chat[:3], add_generation_prompt=False).endswith(f"hello{EOS}")
    ids = tok.encode_chat(chat)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False) == tok.apply_chat_template(chat)
    for marker in ("<｜User｜>", "<｜Assistant｜>"):                 # role markers are single special tokens
        assert ids.count(tok.tok.token_to_id(marker)) == 2


@pytest.mark.parametrize("messages,problem", [
    ([], "non-empty list"), ("hi", "non-empty list"), (["hi"], r"messages\[0\] must be a dict"),
    ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\['role'\]"),
    ([{"content": "b"}], r"messages\[0\]\['role'\]"), ([{"role": "user"}], r"messages\[0\]\['content'\]"),
    ([{"role": "user", "content": ["a"]}], r"messages\[0\]\['content'\] must be a string, got list"),
])
def test_bad_messages_name_the_problem(tok, messages, problem):
    with pytest.raises(ValueError, match=problem): tok.apply_chat_template(messages)
    with pytest.raises(ValueError, match=problem): tok.encode_chat(messages)


def _copy(src, dst, config=None):
    dst.mkdir()
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    if config is not None: (dst / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return dst


def test_template_errors_and_variants(tiny_ckpt, tmp_path):
    cfg = json.loads((tiny_ckpt / "tokenizer_config.json").read_text(encoding="utf-8"))
    bare = Tokenizer.from_dir(_copy(tiny_ckpt, tmp_path / "bare"))
    assert bare.bos_token_id is None and bare.encode("a")[0] == 0        # bos still from the post-processor
    with pytest.raises(ValueError, match="no chat_template"): bare.apply_chat_template([{"role": "user", "content": "x"}])
    named = {**cfg, "chat_template": [{"name": "default", "template": "{{ messages[0]['content'] }}!"}],
             "bos_token": {"content": BOS, "special": True}}
    t = Tokenizer.from_dir(_copy(tiny_ckpt, tmp_path / "named", named))
    assert t.bos_token_id == 0 and t.apply_chat_template([{"role": "user", "content": "x"}]) == "x!"
    refuses = {**cfg, "chat_template": "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}"}
    t = Tokenizer.from_dir(_copy(tiny_ckpt, tmp_path / "refuses", refuses))
    with pytest.raises(ValueError, match="system first"): t.apply_chat_template([{"role": "user", "content": "x"}])
    kw = {**cfg, "chat_template": "{% for m in messages %}\n  {{ m['content'] }}|{{ greeting }}\n{% endfor %}"}
    t = Tokenizer.from_dir(_copy(tiny_ckpt, tmp_path / "kw", kw))                 # trim_blocks / lstrip_blocks
    assert t.apply_chat_template([{"role": "user", "content": "x"}], greeting="hey") == "  x|hey\n"


def test_missing_or_broken_files_are_named(tiny_ckpt, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"): Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json"): Tokenizer.from_dir(tmp_path)
    d = _copy(tiny_ckpt, tmp_path / "cfg")
    (d / "tokenizer_config.json").write_text("{")
    with pytest.raises(ValueError, match="tokenizer_config.json"): Tokenizer.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token '<nope>'"): Tokenizer.from_dir(d)


def stream(tok, ids, chunks, skip=True):
    "Push `ids` in chunks; after each push the emitted text is final and nothing is held back needlessly."
    det, final, pieces, i = IncrementalDetokenizer(tok, skip), tok.decode(ids, skip), [], 0
    for n in chunks:
        pieces.append(det.push(ids[i:i + n])); i += n
        so_far = tok.decode(ids[:i], skip)
        assert final.startswith(det.text) and so_far.startswith(det.text), (ids, pieces)
        if not so_far.endswith(REPLACEMENT): assert det.text == so_far, (ids, pieces)
    pieces.append(det.flush())
    assert "".join(pieces) == det.text == final, (ids, pieces)
    return pieces


def test_multibyte_tokenizer_splits_characters(mtok):
    "The streaming tests below only mean something if characters really are split across ids."
    ids = [i for t in TEXTS for i in mtok.encode(t, add_special_tokens=False)]
    assert sum(REPLACEMENT in mtok.decode([i]) for i in ids) > 50
    assert mtok.decode(mtok.encode("é", add_special_tokens=False)) == "é" and len(mtok.encode("é", add_special_tokens=False)) == 1


@pytest.mark.parametrize("text", [*TEXTS, "ü", "😀", "中文😀", "a\ufffdb", " ".join(TEXTS)])
def test_streaming_text_one_id_at_a_time(tok, mtok, text):
    for t in (tok, mtok):
        ids = t.encode(text, add_special_tokens=False)
        pieces = stream(t, ids, [1] * len(ids))
        assert not any(REPLACEMENT in p for p in pieces) or "\ufffd" in text


@pytest.mark.parametrize("skip", [True, False])
def test_streaming_random_ids(mtok, skip):
    rng, held, permanent = random.Random(int(skip)), 0, 0
    for _ in range(400):
        ids = [rng.randrange(mtok.vocab_size) for _ in range(rng.randrange(1, 40))]
        pieces = stream(mtok, ids, [rng.randint(1, 4) for _ in ids], skip)
        held += pieces.count(""); permanent += any(REPLACEMENT in p for p in pieces[:-1])
    assert held > 100 and permanent > 100                       # both situations were exercised


def test_streaming_encoded_text_in_chunks(mtok):
    rng = random.Random(2)
    for _ in range(100):
        text = "".join(rng.choice(TEXTS + ["😀", "é", "中"]) for _ in range(3))
        ids = mtok.encode(text)
        pieces = stream(mtok, ids, [rng.randint(1, 5) for _ in ids])
        assert "".join(pieces) == text and not any(REPLACEMENT in p for p in pieces)
