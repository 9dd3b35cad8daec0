"""The OpenAI-compatible server, driven as users drive it: a real `python -m dspark.serve` process on
127.0.0.1, the official `openai` client, raw HTTP for the cases the client refuses to send."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from dspark.entrypoints.llm import LLM
from dspark.engine.metrics import scrape, spec_decode_delta
from dspark.sample.sampling import SamplingParams
from serving import ROOT, start_server

MAX_LEN = 256
ARGS = ["--max-model-len", str(MAX_LEN), "--kv-cache-memory-bytes", str(32 * 2**20), "--max-num-seqs", "8",
        "--num-speculative-tokens", "3", "--spec-log-interval", "1"]
KEY = "sk-dspark-test"


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    s = start_server(["--model", str(tiny_ckpt), "--served-model-name", "tiny", "--api-key", KEY, *ARGS],
                     tmp_path_factory.mktemp("serve"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    "The same checkpoint and settings in-process: the server must agree with it."
    return LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=3, max_model_len=MAX_LEN,
               kv_cache_memory_bytes=32 * 2**20, max_num_seqs=8)


def post(server, path, body=None, key=KEY, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers | kw.pop("headers", {}), timeout=120, **kw)


def test_models_health_version(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"] and models[0].max_model_len == MAX_LEN
    assert client.models.retrieve("tiny").id == "tiny"                    # GET /v1/models/{model}
    with pytest.raises(openai.NotFoundError, match="does not exist"): client.models.retrieve("org/other")
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/version").json()["version"]


def test_vllm_sampling_extensions_are_applied(client, offline):
    """presence/frequency/repetition penalties, min_p, min_tokens and logit_bias (vLLM's through `extra_body`) reach
    the engine: the server's greedy tokens equal `LLM.generate` with the same `SamplingParams`, on completions and
    chat, and a +100 bias forces its token."""
    kw = dict(presence_penalty=1.0, frequency_penalty=0.5)
    extra = dict(repetition_penalty=1.5, min_p=0.1, min_tokens=4, ignore_eos=True, logit_bias={"42": 3.0})
    sp = SamplingParams(temperature=0.0, max_tokens=10, **kw, **(extra | {"logit_bias": {42: 3.0}}))
    ref = offline.generate(["Simple is"], sp, use_tqdm=False)[0].outputs[0].token_ids
    got = client.completions.create(model="tiny", prompt="Simple is", max_tokens=10, temperature=0, **kw, extra_body=extra)
    assert got.usage.completion_tokens == 10 and got.choices[0].text == offline.tokenizer.decode(ref)
    forced = offline.generate(["hi"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={42: 100}),
                              use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [42] * 4
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 4 and chat.choices[0].message.content == forced.text


def test_greedy_completion_equals_llm_generate(client, offline):
    prompts = ["Beautiful is better than", "Simple is", "In the face of ambiguity"]
    ref = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    for p, r in zip(prompts, ref):
        out = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0)
        assert out.choices[0].text == r.outputs[0].text
        assert out.choices[0].finish_reason == r.outputs[0].finish_reason == "length"
        assert out.usage.completion_tokens == 16 and out.usage.prompt_tokens == len(r.prompt_token_ids)
    ids = ref[0].prompt_token_ids
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=16, temperature=0)   # token ids as prompt
    assert out.choices[0].text == ref[0].outputs[0].text


def test_streaming_equals_non_streaming_and_usage_chunk(client):
    kw = dict(model="tiny", prompt="Now is better than never", max_tokens=24, temperature=1.0, seed=11)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 24
    assert sum(1 for c in chunks if c.choices) >= 2


def test_chat_streaming_and_seeds(client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the Zen of Python?"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=20, temperature=1.0, seed=5)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert a.choices[0].message.content == b.choices[0].message.content          # a seed reproduces
    assert a.choices[0].message.role == "assistant" and a.object == "chat.completion"
    other = client.chat.completions.create(**(kw | {"seed": 6}))
    assert other.choices[0].message.content != a.choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == a.choices[0].message.content
    assert chunks[-1].usage.total_tokens == a.usage.total_tokens
    new = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=7, temperature=0)
    assert new.usage.completion_tokens == 7


def test_add_generation_prompt_false_leaves_the_assistant_opening_off(client, offline):
    """vLLM's `add_generation_prompt`: False renders the messages without the assistant's opening, so the prompt
    is exactly `encode_chat(..., add_generation_prompt=False)` and the greedy reply is `LLM.generate`'s on it."""
    msgs = [{"role": "user", "content": "Beautiful is better than"}]
    kw = dict(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    on, off = client.chat.completions.create(**kw), client.chat.completions.create(**kw, extra_body={"add_generation_prompt": False})
    ids = offline.tokenizer.encode_chat(msgs, add_generation_prompt=False)
    assert off.usage.prompt_tokens == len(ids) < on.usage.prompt_tokens == len(offline.tokenizer.encode_chat(msgs))
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].text
    assert off.choices[0].message.content == want


def test_stop_sequences(client):
    kw = dict(model="tiny", prompt="Errors should never pass silently", max_tokens=40, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[10:13]
    assert stop and text.index(stop) >= 1
    out = client.completions.create(**kw, stop=[stop, "\x00never"])
    assert out.choices[0].text == text[: text.index(stop)] and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == out.choices[0].text


def test_n_choices(client):
    out = client.completions.create(model="tiny", prompt="Flat is better than", max_tokens=12, temperature=1.0, n=3, seed=1,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1
    one = client.completions.create(model="tiny", prompt="Flat is better than", max_tokens=12, temperature=1.0, n=1, seed=1,
                                    extra_body={"ignore_eos": True})
    assert one.choices[0].text == out.choices[0].text                            # choice 0 keeps the seed
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, n=2, seed=3, stream=True))
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}
    assert out.usage.completion_tokens == 36


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt="Sparse is better", max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5     # (alternatives that decode to
    assert all(v == max(top.values()) for v, top in zip(lp.token_logprobs, lp.top_logprobs))  # the same text merge)
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)   # greedy picks the top


def test_request_id_header(server):
    r = post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2}, headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"
    assert r.json()["id"].startswith("cmpl-") and "abc-123" not in r.json()["id"]     # response ids are the server's
    assert post(server, "/v1/completions", {"prompt": "a", "max_tokens": 2}).headers["x-request-id"]


def test_tokenize_detokenize(server, offline):
    r = post(server, "/tokenize", {"prompt": "Readability counts."}).json()
    assert r["tokens"] == offline.tokenizer.encode("Readability counts.") and r["count"] == len(r["tokens"])
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json()["prompt"] == "Readability counts."
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400


BAD = [  # (name, path, body or raw bytes, status, field/message fragment)
    ("malformed json", "/v1/completions", b'{"prompt": "x", ', 400, "JSON"),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 4}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "4"}, 400, "max_tokens"),
    ("temperature wrong type", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("stream wrong type", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("temperature -1", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("max_tokens 0", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens absurd", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "maximum context length"),
    ("prompt too long", "/v1/completions", {"prompt": "a b " * 400, "max_tokens": 1}, 400, "max_model_len"),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 2, 10**6]}, 400, "vocabulary"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "empty"),
    ("n too large", "/v1/completions", {"prompt": "x", "n": 1000}, 400, "n must"),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("unsupported field", "/v1/completions", {"prompt": "x", "tools": []}, 400, "tools"),
    ("best_of beyond n", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("beam search", "/v1/completions", {"prompt": "x", "use_beam_search": True}, 400, "use_beam_search"),
    ("skip_special_tokens wrong type", "/v1/completions", {"prompt": "x", "skip_special_tokens": "no"}, 400, "skip_special_tokens"),
    ("prompt_logprobs too many", "/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("prompt_logprobs on a stream", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, 400, "prompt_logprobs"),
    ("prompt_logprobs wrong type", "/v1/completions", {"prompt": "x", "prompt_logprobs": "2"}, 400, "prompt_logprobs"),
    ("presence_penalty out of range", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("repetition_penalty 0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min_p out of range", "/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "min_p"),
    ("min_tokens wrong type", "/v1/completions", {"prompt": "x", "min_tokens": "3"}, 400, "min_tokens"),
    ("logit_bias out of range", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit_bias id out of vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"100000": 1}}, 400, "vocabulary"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-5"}, 404, "gpt-5"),
    ("oversized body", "/v1/completions", {"prompt": "x" * (5 * 2**20)}, 413, "larger than"),
    ("unknown route", "/v1/engines", {"prompt": "x"}, 404, "Not Found"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "ab\\ud800c", "max_tokens": 2}', 400, "lone surrogate U+D800"),
    ("lone surrogate in chat", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}', 400, "lone surrogate U+DFFF"),
    ("GBNF that does not parse", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "structured_outputs": {"grammar": "root ::= ("}}, 400, "GBNF: Expected ')'"),
    ("image content part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}, 400, "content part of type 'image_url' is not supported"),
    ("GBNF without root", "/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": 'foo ::= "x"'}}, 400, "No 'root' rule"),
]


@pytest.mark.parametrize("name,path,body,status,fragment", BAD, ids=[b[0] for b in BAD])
def test_bad_input(server, client, name, path, body, status, fragment):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {}
    r = post(server, path, None if kw else body, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert fragment.lower() in err["message"].lower(), err
    ok = client.completions.create(model="tiny", prompt="Simple is", max_tokens=3, temperature=0)   # still serving
    assert ok.usage.completion_tokens == 3


@pytest.mark.parametrize("key", [None, "sk-wrong"])
def test_api_key(server, key):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, key=key)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    if key:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0).models.list()
    assert httpx.get(server.url + "/metrics").status_code == 200                # probes stay open


def test_bad_input_through_the_openai_client(client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def _wait_idle(server, timeout=60):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        m = scrape(server.metrics())
        if m.get("vllm:num_requests_running") == 0 and m.get("vllm:num_requests_waiting") == 0: return m
        time.sleep(0.1)
    raise AssertionError("server did not go idle")


def test_disconnect_aborts_and_frees_blocks(server):
    before = _wait_idle(server)
    free = {g: before[f"dspark:kv_cache_free_blocks{{group={g}}}"] for g in ("compressed", "window")}
    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": "Special cases", "max_tokens": 200, "stream": True, "ignore_eos": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"): break                                 # one chunk, then hang up
    after = _wait_idle(server)
    assert {g: after[f"dspark:kv_cache_free_blocks{{group={g}}}"] for g in free} == free
    assert after['vllm:request_success_total{finished_reason=abort}'] >= 1
    assert after["vllm:generation_tokens_total"] < before.get("vllm:generation_tokens_total", 0) + 200


def test_metrics_acceptance_matches_spec_stats(server, client, tiny_ckpt):
    prompts = ["Although never is often better", "If the implementation is hard to explain", "Namespaces are"]
    _wait_idle(server)
    before = server.metrics()
    for p in prompts: client.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0)
    delta = spec_decode_delta(before, server.metrics())
    llm = LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=3, max_model_len=MAX_LEN,
              kv_cache_memory_bytes=32 * 2**20, max_num_seqs=8, enable_prefix_caching=False)
    for p in prompts: llm.generate([p], SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    st = llm.spec_stats()
    assert delta["num_drafts"] == st["num_drafts"] > 0
    for k in ("num_draft_tokens", "num_accepted_tokens", "accepted_per_position"): assert delta[k] == st[k]
    assert delta["mean_acceptance_length"] == pytest.approx(st["mean_acceptance_length"])
    m = scrape(server.metrics())
    for name in ("vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total"):
        assert m[name] > 0, name
    assert "SpecDecoding metrics: Mean acceptance length" in server.output()


def test_overload_gets_503_with_retry_after(tiny_ckpt, tmp_path):
    s = start_server(["--model", str(tiny_ckpt), *ARGS[:4], "--max-num-seqs", "1", "--max-waiting-requests", "1"], tmp_path)
    try:
        body = {"prompt": "x", "max_tokens": 60, "ignore_eos": True}
        with httpx.Client(timeout=120) as c:
            streams = [c.stream("POST", s.url + "/v1/completions", json=body | {"stream": True}) for _ in range(2)]
            opened = [st.__enter__() for st in streams]
            r = c.post(s.url + "/v1/completions", json=body)
            assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == 503
            for st in streams: st.__exit__(None, None, None)
        assert all(o.status_code == 200 for o in opened)
    finally:
        s.stop()


def test_sigterm_drains_running_requests(tiny_ckpt, tmp_path):
    s = start_server(["--model", str(tiny_ckpt), *ARGS], tmp_path)
    with httpx.stream("POST", s.url + "/v1/completions",
                      json={"prompt": "Unless explicitly silenced", "max_tokens": 40, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}, timeout=120) as r:
        lines = r.iter_lines()
        first = next(l for l in lines if l.startswith("data: {"))
        s.proc.send_signal(15)                                                    # SIGTERM mid-stream
        rest = [l for l in lines if l.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["usage"]["completion_tokens"] == 40
    assert s.proc.wait(60) == 0                 # a drained shutdown is a clean exit
    with pytest.raises(httpx.ConnectError):
        httpx.post(s.url + "/v1/completions", json={"prompt": "x"}, timeout=5)


def test_launcher_environment_and_dry_run(tiny_ckpt):
    env = {"DSPARK_NUM_SPECULATIVE_TOKENS": "2", "DSPARK_MAX_NUM_SEQS": "7", "DSPARK_API_KEY": "secret", "PATH": ""}
    r = subprocess.run([sys.executable, "-m", "dspark.serve", "--model", str(tiny_ckpt), "--dry-run"],
                       capture_output=True, text=True, env=env | {"OMP_NUM_THREADS": "1"}, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    conf = json.loads(r.stdout[r.stdout.index("{"): r.stdout.index("}") + 1])
    assert conf["num_speculative_tokens"] == 2 and conf["max_num_seqs"] == 7 and conf["speculative"] == "dspark"
    assert conf["api_key"] == "***" and "secret" not in r.stdout
    assert "KV cache:" in r.stdout and "max concurrency" in r.stdout and "weights on disk" in r.stdout
    flag_wins = subprocess.run([sys.executable, "-m", "dspark.serve", "--model", str(tiny_ckpt), "--dry-run",
                                "--num-speculative-tokens", "4"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert '"num_speculative_tokens": 4' in flag_wins.stdout
    for bad, msg in ((["--num-speculative-tokens", "9"], "num_speculative_tokens"), (["--speculative", "eagle"], "invalid choice"),
                     (["--model", "/nonexistent"], "config.json"), (["--tensor-parallel-size", "3"], "must divide")):
        r = subprocess.run([sys.executable, "-m", "dspark.serve", "--model", str(tiny_ckpt), "--dry-run", *bad],
                           capture_output=True, text=True, env={"PATH": ""}, cwd=ROOT, timeout=120)
        assert r.returncode != 0 and msg in r.stderr + r.stdout


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client):
    "vLLM's `stream_options.continuous_usage_stats` (guidellm and aiperf always send it)."
    kw = dict(model="tiny", prompt="Now is better than never", max_tokens=12, temperature=0.0)
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counted and counted == sorted(counted) and all(c.usage.prompt_tokens > 0 for c in chunks)
    assert chunks[-1].choices == [] and counted[-1] == chunks[-1].usage.completion_tokens == 12
    plain = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)


def test_head_answers_wherever_get_does(server):
    for path in ("/health", "/version", "/metrics", "/v1/models"):
        r = httpx.head(server.url + path, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200 and r.content == b"", path


def test_fields_no_api_defines_are_ignored(client):
    "Issue 44: a top-level field nobody defines is logged and ignored (as vLLM does); OpenAI's and vLLM's at neutral pass."
    ref = client.completions.create(model="tiny", prompt="Simple is", max_tokens=4, temperature=0)
    got = client.completions.create(model="tiny", prompt="Simple is", max_tokens=4, temperature=0, best_of=1, suffix=None,
                                    extra_body={"frobnicate": {"x": 1}, "skip_special_tokens": True, "priority": 0})
    assert got.choices[0].text == ref.choices[0].text


def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    "The target's log-probabilities at every prompt position, from a plain full forward: row j predicts token j + 1."
    return model.logits(torch.tensor([ids]))[0].log_softmax(-1)


def test_echo_with_logprobs_is_lm_evals_loglikelihood(server, offline, tiny_model):
    """lm-eval's `local-completions` loglikelihood request (token ids, `echo`, `logprobs: 1`, `max_tokens: 1`): the
    prompt's tokens come back before the completion with their logprobs — the first null — equal to the target's."""
    ids = offline.encode_prompt("Beautiful is better than ugly. Explicit is")[1]
    body = {"model": "tiny", "prompt": [ids], "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ref = reference_logprobs(tiny_model, ids)
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [ref[j - 1, t].item() for j, t in enumerate(ids) if j]
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:len(ids)], want)) < 1e-4
    for j in range(1, len(ids)):                                       # the best alternative is the target's argmax
        assert max(lp["top_logprobs"][j].values()) == pytest.approx(ref[j - 1].max().item(), abs=1e-4)
    alone = post(server, "/v1/completions", body | {"max_tokens": 0}).json()["choices"][0]   # the prompt alone
    assert alone["text"] == offline.tokenizer.decode(ids) and alone["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]


def test_echo_text_and_stream(client):
    "`echo` puts the prompt's text before each choice's, streamed or not; the stream spells the same text."
    whole = client.completions.create(model="tiny", prompt=["Simple is", "Flat is"], max_tokens=4, temperature=0, echo=True, n=2)
    plain = client.completions.create(model="tiny", prompt=["Simple is", "Flat is"], max_tokens=4, temperature=0, n=2)
    assert [c.text for c in whole.choices] == [p + c.text for p, c in zip(["Simple is"] * 2 + ["Flat is"] * 2, plain.choices)]
    chunks = list(client.completions.create(model="tiny", prompt="Simple is", max_tokens=4, temperature=0, echo=True,
                                            logprobs=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[0].choices[0].logprobs.token_logprobs[0] is None


def test_prompt_logprobs_skip_the_prefix_cache(server, tiny_model):
    """vLLM's `prompt_logprobs: k`: per prompt token its logprob, rank and the top k (the first null), computed from the
    prefill — so a request that asks for them reuses no cached prefix, while a plain one with the same prompt does."""
    ids = [5 + (7 * i) % 400 for i in range(150)]                      # more than two 64-token blocks
    plain = {"model": "tiny", "prompt": ids, "max_tokens": 2, "temperature": 0}
    post(server, "/v1/completions", plain)
    assert post(server, "/v1/completions", plain).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    r = post(server, "/v1/completions", plain | {"prompt_logprobs": 2}).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plp, ref = r["choices"][0]["prompt_logprobs"], reference_logprobs(tiny_model, ids)
    assert len(plp) == len(ids) and plp[0] is None
    for j in (1, 70, 149):
        row, t = plp[j], ids[j]
        assert row[str(t)]["logprob"] == pytest.approx(ref[j - 1, t].item(), abs=1e-4)
        assert row[str(t)]["rank"] == int((ref[j - 1] > ref[j - 1, t]).sum()) + 1
        top = sorted((v for k, v in row.items() if v["rank"] <= 2), key=lambda v: v["rank"])
        assert [v["logprob"] for v in top][:2] == pytest.approx(ref[j - 1].topk(2).values.tolist(), abs=1e-4)


def test_output_options_through_extra_body(client, offline):
    """vLLM's `skip_special_tokens`, `spaces_between_special_tokens` and `include_stop_str_in_output` through the
    `openai` client's `extra_body`, on completions and chat, streamed and not: the text `LLM.generate` gives."""
    eos = offline.tokenizer.eos_token_id
    special = dict(ignore_eos=True, logit_bias={str(eos): 8.0}, skip_special_tokens=False, spaces_between_special_tokens=False)
    sp = SamplingParams(temperature=0.0, max_tokens=10, **(special | {"logit_bias": {eos: 8.0}}))
    kept = offline.generate(["Simple is"], sp, use_tqdm=False)[0].outputs[0].text
    assert offline.tokenizer.eos_token in kept
    kw = dict(model="tiny", prompt="Simple is", max_tokens=10, temperature=0)
    assert client.completions.create(**kw, extra_body=special).choices[0].text == kept
    assert "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True, extra_body=special)) == kept
    plain = client.completions.create(**kw, extra_body=special | {"skip_special_tokens": True}).choices[0].text
    assert plain == kept.replace(offline.tokenizer.eos_token, "")
    base = client.completions.create(**(kw | {"max_tokens": 40})).choices[0].text
    stop = base[10:13]
    for cut, extra in ((base[: base.index(stop)], {}), (base[: base.index(stop) + 3], {"include_stop_str_in_output": True})):
        out = client.completions.create(**(kw | {"max_tokens": 40}), stop=[stop], extra_body=extra)
        assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
        streamed = client.completions.create(**(kw | {"max_tokens": 40}), stop=[stop], stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in streamed) == cut
    msgs = [{"role": "user", "content": "hi"}]
    ckw = dict(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**ckw, extra_body={"ignore_eos": True}).choices[0].message.content
    stop = full[4:7]
    for cut, extra in ((full[: full.index(stop)], {}), (full[: full.index(stop) + 3], {"include_stop_str_in_output": True})):
        got = client.chat.completions.create(**ckw, stop=[stop], extra_body={"ignore_eos": True} | extra)
        assert got.choices[0].message.content == cut
        chunks = client.chat.completions.create(**ckw, stop=[stop], stream=True, extra_body={"ignore_eos": True} | extra)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == cut
    chat_kept = client.chat.completions.create(**ckw, extra_body=special).choices[0].message.content
    assert offline.tokenizer.eos_token in chat_kept
    chunks = client.chat.completions.create(**ckw, stream=True, extra_body=special)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_kept
