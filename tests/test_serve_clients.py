"""The clients users already drive vLLM with, pointed at `python -m dspark.serve` unchanged (issue 44): LangChain's
`ChatOpenAI`/`OpenAI`, LiteLLM, and the request bodies guidellm, `vllm bench serve` and aiperf send, replayed with
httpx exactly as those tools write them. One tiny server for the module; each test is quick."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from serving import start_server

pytestmark = pytest.mark.clients
KEY, N = "sk-dspark-clients", 6
ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(32 * 2**20), "--max-num-seqs", "8",
        "--num-speculative-tokens", "3"]
PROMPT = "Beautiful is better than"


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    s = start_server(["--model", str(tiny_ckpt), "--served-model-name", "tiny", "--api-key", KEY, *ARGS],
                     tmp_path_factory.mktemp("clients"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(server):
    return server.url + "/v1"


# --- LangChain (langchain-openai) ---------------------------------------------------------------------------------

def test_langchain_chat_openai(base):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model="tiny", base_url=base, api_key=KEY, max_tokens=N, temperature=0, max_retries=0)
    one = llm.invoke("Say something")
    assert isinstance(one.content, str) and one.response_metadata["finish_reason"] in ("stop", "length")
    assert one.usage_metadata["output_tokens"] <= N
    chunks = list(llm.stream("Say something"))
    assert "".join(c.content for c in chunks) == one.content          # greedy: the stream spells the same text
    batch = llm.batch(["Say something", "Say more"])
    assert len(batch) == 2 and batch[0].content == one.content


def test_langchain_openai_completions(base):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.OpenAI(model="tiny", base_url=base, api_key=KEY, max_tokens=N, temperature=0, max_retries=0)
    one = llm.invoke(PROMPT)
    assert isinstance(one, str)
    assert "".join(llm.stream(PROMPT)) == one
    assert llm.batch([PROMPT, "Simple is"])[0] == one                # one request with a list of prompts


# --- LiteLLM ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def litellm():
    "LiteLLM, imported once (about 3 s of imports, outside the test's own time)."
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no fetch of the price list at import
    return pytest.importorskip("litellm")


def test_litellm(base, litellm):
    kw = dict(model="openai/tiny", api_base=base, api_key=KEY, max_tokens=N, temperature=0,
              messages=[{"role": "user", "content": "Say something"}])
    one = litellm.completion(**kw)
    text = one.choices[0].message.content
    assert one.usage.completion_tokens <= N and isinstance(text, str)
    streamed = "".join(c.choices[0].delta.content or "" for c in litellm.completion(**kw, stream=True))
    assert streamed == text
    assert litellm.completion(**kw, presence_penalty=0.5).choices[0].finish_reason in ("stop", "length")   # issue 44


# --- recorded request bodies of the benchmark tools ----------------------------------------------------------------
# Each body is written as the tool builds it (`N` output tokens, the served name as the model):
# - guidellm: vllm-project/guidellm src/guidellm/backends/openai/request_handlers.py, `TextCompletionsRequestHandler.
#   format` and `ChatCompletionsRequestHandler.format` — streaming (its default) always sends vLLM's
#   `continuous_usage_stats`; a fixed output length sends `stop: null` and `ignore_eos: true`; chat content as parts.
# - vllm bench serve: vllm-project/vllm vllm/benchmarks/lib/endpoint_request_func.py, `async_request_openai_completions`
#   (`repetition_penalty: 1.0`, `logprobs: null`) and `async_request_openai_chat_completions` (`max_completion_tokens`,
#   content as parts); `--ignore-eos` adds `ignore_eos`, and the sampling flags arrive through `extra_body`
#   (`temperature: 0.0` unless given, vllm/benchmarks/serve.py).
# - aiperf: ai-dynamo/aiperf src/aiperf/endpoints/openai_completions.py (`prompt` as a list, `stream_options.
#   include_usage` for server token counts) and openai_chat.py (`max_completion_tokens`; `--per-chunk-usage` adds
#   `continuous_usage_stats`); a single text turn is a plain string (base_endpoint.py `_render_turn_content`).
STREAM_FULL = {"include_usage": True, "continuous_usage_stats": True}
BODIES = {
    "guidellm completions": ("/completions", {"model": "tiny", "stream": True, "stream_options": STREAM_FULL,
                                              "max_tokens": N, "stop": None, "ignore_eos": True, "prompt": PROMPT}),
    "guidellm chat": ("/chat/completions", {"model": "tiny", "stream": True, "stream_options": STREAM_FULL,
                                            "max_completion_tokens": N, "stop": None, "ignore_eos": True,
                                            "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}]}),
    "vllm bench completions": ("/completions", {"model": "tiny", "prompt": PROMPT, "repetition_penalty": 1.0,
                                                "max_tokens": N, "logprobs": None, "stream": True,
                                                "stream_options": {"include_usage": True}, "ignore_eos": True,
                                                "temperature": 0.0}),
    "vllm bench chat": ("/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
                            {"type": "text", "text": PROMPT}]}], "max_completion_tokens": N, "stream": True,
                        "stream_options": {"include_usage": True}, "ignore_eos": True, "temperature": 0.0}),
    "aiperf completions": ("/completions", {"prompt": [PROMPT], "model": "tiny", "stream": True, "max_tokens": N,
                                            "stream_options": {"include_usage": True}}),
    "aiperf chat per-chunk usage": ("/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                          "model": "tiny", "stream": True, "max_completion_tokens": N,
                                                          "stream_options": STREAM_FULL}),
    "aiperf chat non-streaming": ("/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                                                        "model": "tiny", "stream": False, "max_completion_tokens": N}),
}


@pytest.mark.parametrize("name", list(BODIES))
def test_benchmark_tool_bodies(base, name):
    path, body = BODIES[name]
    r = httpx.post(base + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    if not body["stream"]:
        assert r.json()["usage"]["completion_tokens"] <= N
        return
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    final = chunks[-1]                                                  # include_usage: the last chunk, no choices
    assert final["choices"] == [] and 1 <= final["usage"]["completion_tokens"] <= N
    if body.get("ignore_eos"): assert final["usage"]["completion_tokens"] == N
    if body["stream_options"].get("continuous_usage_stats"):          # every chunk carries the usage so far
        assert all("usage" in c for c in chunks)
