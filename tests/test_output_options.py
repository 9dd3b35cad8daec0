"""vLLM's output options (issue 44): `skip_special_tokens`, `spaces_between_special_tokens` and
`include_stop_str_in_output`, on the embedded model with DSpark speculation off and on — the same seeded output,
exact text — and streamed deltas that add up to the final text (nothing emitted is ever taken back)."""
import pytest

import dspark
from dspark import SamplingParams
from dspark.engine.outputs import StopMatcher

KV = dict(max_num_seqs=4, max_num_batched_tokens=256, kv_cache_memory_bytes=32 * 2**20)
PROMPT = "Beautiful is better than"
PLAIN = " 2.5.0.0, and not a bit of the b"                 # the embedded model's greedy 16 tokens after PROMPT
EOS, BOS = "<｜end▁of▁sentence｜>", "<｜begin▁of▁sentence｜>"


@pytest.fixture(scope="module")
def pair():
    return dspark.LLM(**KV), dspark.LLM(speculative="dspark", **KV)


def both(pair, **kw):
    "The output (text, finish reason, tokens) with speculation off and on, checked equal; and the streamed text."
    sp = SamplingParams(temperature=0.0, seed=7, max_tokens=16, **kw)
    outs = [llm.generate([PROMPT], sp, use_tqdm=False)[0].outputs[0] for llm in pair]
    got = [(o.text, o.finish_reason, o.token_ids) for o in outs]
    assert got[0][:2] == got[1][:2], got      # with stop strings a round may commit tokens past the cut (text only equal)
    assert kw.get("stop") or got[0][2] == got[1][2], got
    for llm in pair:                                          # streamed: the deltas spell the final text
        rid = llm.add_request(PROMPT, SamplingParams(temperature=0.0, seed=7, max_tokens=16, **kw))
        deltas = []
        while llm.has_unfinished_requests(): deltas += [d for d in llm.step() if d.request_id == rid]
        assert "".join(d.text for d in deltas) == got[0][0] and deltas[-1].finish_reason == got[0][1]
    return got[0]


def test_defaults_are_vllms(pair):
    sp = SamplingParams()
    assert sp.skip_special_tokens and sp.spaces_between_special_tokens and not sp.include_stop_str_in_output
    assert both(pair)[0] == PLAIN
    with pytest.raises(ValueError, match="SamplingParams.skip_special_tokens"): SamplingParams(skip_special_tokens=0)
    with pytest.raises(ValueError, match="include_stop_str_in_output"): SamplingParams(include_stop_str_in_output="yes")


def test_skip_special_tokens(pair):
    "A bias of +10 on eos makes the model emit specials mid-text (eos ignored): left out by default, kept with False."
    kw = dict(ignore_eos=True, logit_bias={1: 10.0})
    text, _, toks = both(pair, **kw)
    assert toks[6:] == [1, 0] * 5 and text == " 2.5.0."
    kept, _, toks2 = both(pair, skip_special_tokens=False, **kw)
    assert toks2 == toks and kept == " 2.5.0." + (EOS + BOS) * 5
    assert both(pair, skip_special_tokens=False, spaces_between_special_tokens=False, **kw)[0] == kept


def test_eos_text_only_with_include_stop_str(pair):
    "As vLLM: the token that stops a request (eos) is not detokenised unless `include_stop_str_in_output`."
    kw = dict(logit_bias={1: 10.0})
    assert both(pair, **kw)[:2] == (" 2.5.0.", "stop")
    assert both(pair, skip_special_tokens=False, **kw)[:2] == (" 2.5.0.", "stop")
    assert both(pair, skip_special_tokens=False, include_stop_str_in_output=True, **kw)[:2] == (" 2.5.0." + EOS, "stop")
    assert both(pair, include_stop_str_in_output=True, **kw)[:2] == (" 2.5.0.", "stop")    # skipped as special


@pytest.mark.parametrize("stop,cut,kept", [(["0."], " 2.5.", " 2.5.0."),
                                           (["and not", "bit"], " 2.5.0.0, ", " 2.5.0.0, and not"),
                                           (["not a bit of"], " 2.5.0.0, and ", " 2.5.0.0, and not a bit of")])
def test_include_stop_str_in_output(pair, stop, cut, kept):
    assert both(pair, stop=stop)[:2] == (cut, "stop")
    text, reason, _ = both(pair, stop=stop, include_stop_str_in_output=True)
    assert (text, reason) == (kept, "stop") and PLAIN.startswith(text)


def test_spaces_between_special_tokens_on_a_spacing_decoder():
    """With a decoder that joins tokens with spaces (no decoder at all), False joins special tokens to their
    neighbours with no space, as vLLM's `"".join` of the runs between them; True keeps the tokenizer's own text."""
    import tokenizers
    from dspark.tokenizer import Tokenizer
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<s>": 2, "</s>": 3}, unk_token="a"))
    tok.add_special_tokens(["<s>", "</s>"])
    t = Tokenizer(tok)
    assert t.decode([0, 1, 2, 3, 0], skip_special_tokens=False) == "a b <s> </s> a"
    assert t.decode([0, 1, 2, 3, 0], skip_special_tokens=False, spaces_between_special_tokens=False) == "a b<s></s>a"
    assert t.decode([0, 1, 2, 3, 0], spaces_between_special_tokens=False) == "a b a"


def test_stop_matcher_keep_cuts_after_the_winner():
    m, k = StopMatcher(["cd", "b"]), StopMatcher(["cd", "b"], keep=True)
    assert m.find("abcd", 0) == 2 and k.find("abcd", 0) == 4      # the first-listed string wins, as in vLLM
    assert m.find("xbcd", 3) == 2 and k.find("xbcd", 3) == 4      # occurrences that end before `sent` are old
    assert m.find("xb", 0) == 1 and k.find("xb", 0) == 2


def test_a_step_of_several_tokens_stops_where_one_token_a_step_would(pair):
    """lm-eval's `until: ["\\n", "."]` found this: a step that commits several tokens (speculation) used to let the
    first-listed stop string win over one that the text completed tokens earlier (cut at "\\n" after "."). The
    text is now checked token by token, so where it stops is the same with speculation on and off."""
    from dspark.engine.outputs import push_until_stop
    from dspark.tokenizer import IncrementalDetokenizer
    tok = pair[0].tokenizer
    ids = tok.encode(" not in the C API.\nMore", add_special_tokens=False)
    for keep, want in ((False, " not in the C API"), (True, " not in the C API.")):
        text, cut = push_until_stop(IncrementalDetokenizer(tok), "", ids, StopMatcher(["\n", "."], keep), 0)
        assert text[:cut] == want, (keep, text, cut)
    text, cut = push_until_stop(IncrementalDetokenizer(tok), "", ids, StopMatcher(["\n", "."]), 0, min_tokens=len(ids))
    assert cut is None and text == " not in the C API.\nMore"          # no token before min_tokens completes one
    assert both(pair, stop=["\n", " and", ","])[:2] == (" 2.5.0.0", "stop")
    assert both(pair, stop=["of the", "not"], include_stop_str_in_output=True)[:2] == (" 2.5.0.0, and not", "stop")
