"""Chat as DeepSeek-V4 users run it: the V4 encoding against hand-written strings of its specification
(vllm-project/vllm `vllm/tokenizers/deepseek_v4_encoding.py`), the reasoning and DSML tool-call parsers fed
token by token, the streamed fragments reassembled by the `openai` client's own accumulator, and the server
accepting `tools`, `tool_choice` and `chat_template_kwargs`."""
from __future__ import annotations

import json
from typing import Literal
import shutil

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from dspark.entrypoints.chat_output import ChatStream, ReasoningSplitter, ToolCallParser, parse_tool_calls
from dspark.entrypoints.chat_v4 import encode_messages
from serving import start_server

B, E = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities, two calls.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},      # answered out of order: sorted by call order
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "assistant", "content": "Paris is sunny; Tokyo has rain.", "reasoning_content": "Both known."},
    {"role": "user", "content": "Thanks!"},
]

# written out by hand from the specification's TOOLS_TEMPLATE
TOOLS = ('## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You can invoke tools by '
         f'writing a "<{D}tool_calls>" block like the following:\n\n<{D}tool_calls>\n<{D}invoke name="$TOOL_NAME">\n'
         f'<{D}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</{D}parameter>\n...\n</{D}invoke>\n'
         f'<{D}invoke name="$TOOL_NAME2">\n...\n</{D}invoke>\n</{D}tool_calls>\n\n'
         'String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, '
         'arrays, objects), pass the value in JSON format and set `string="false"`.\n\n'
         'If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside '
         '<think>...</think> BEFORE any tool calls or final response.\n\n'
         'Otherwise, output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n'
         '{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", "properties": '
         '{"city": {"type": "string"}, "days": {"type": "integer"}}}}\n\n'
         'You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n')
CALLS = (f'\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n'
         f'</{D}invoke>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Tokyo</{D}parameter>\n'
         f'<{D}parameter name="days" string="false">2</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>')


def test_encoding_thinking_off():
    want = (f"{B}You are a helpful assistant.\n\n{TOOLS}{U}Weather in Paris and Tokyo?{A}</think>{CALLS}{E}"
            f"{U}<tool_result>sunny</tool_result>\n\n<tool_result>rain</tool_result>{A}</think>"
            f"Paris is sunny; Tokyo has rain.{E}{U}Thanks!{A}</think>")
    assert encode_messages(CONVERSATION, [WEATHER], thinking=False) == want


def test_encoding_thinking_on_keeps_reasoning_with_tools():
    want = (f"{B}You are a helpful assistant.\n\n{TOOLS}{U}Weather in Paris and Tokyo?{A}<think>Two cities, two calls."
            f"</think>{CALLS}{E}{U}<tool_result>sunny</tool_result>\n\n<tool_result>rain</tool_result>{A}<think>"
            f"Both known.</think>Paris is sunny; Tokyo has rain.{E}{U}Thanks!{A}<think>")
    assert encode_messages(CONVERSATION, [WEATHER], thinking=True) == want


def test_encoding_drops_earlier_reasoning_and_max_effort():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "Hi!", "reasoning_content": "greet"}, {"role": "user", "content": "1+1=?"}]
    assert encode_messages(msgs, thinking=True) == f"{B}S{U}hello{A}</think>Hi!{E}{U}1+1=?{A}<think>"
    assert encode_messages(msgs, thinking=False) == f"{B}S{U}hello{A}</think>Hi!{E}{U}1+1=?{A}</think>"
    assert encode_messages(msgs, thinking=True, add_generation_prompt=False) == f"{B}S{U}hello{A}</think>Hi!{E}{U}1+1=?"
    maxed = encode_messages(msgs, thinking=True, reasoning_effort="max")
    assert maxed.startswith(B + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n") and maxed.endswith("{A}<think>".format(A=A))
    assert encode_messages(msgs, thinking=False, reasoning_effort="max") == encode_messages(msgs, thinking=False)
    assert encode_messages(msgs, thinking=True, reasoning_effort="none") == encode_messages(msgs, thinking=False)
    assert encode_messages([{"role": "user", "content": "x"}], [WEATHER]) == f"{B}\n\n{TOOLS}{U}x{A}</think>"
    with pytest.raises(ValueError): encode_messages(msgs, reasoning_effort="extreme")


def pieces(text: str) -> list[str]:
    "Token-like pieces of 1-3 characters, so markers are cut in every place."
    out, i, k = [], 0, 0
    while i < len(text):
        n = 1 + k % 3; out.append(text[i:i + n]); i += n; k += 1
    return out


@pytest.mark.parametrize("text, thinking, reasoning, content", [
    ("Let me think.</think>The answer is 2.", True, "Let me think.", "The answer is 2."),
    ("<think>again</think>ok", True, "again", "ok"),
    ("never closed", True, "never closed", ""),
    ("no thinking </think> here", False, "", "no thinking </think> here"),
    (f"plan<{D}tool_calls>x", True, "plan", f"<{D}tool_calls>x"),
])
def test_reasoning_split_whole_and_streamed(text, thinking, reasoning, content):
    for chunks in ([text], pieces(text), list(text)):
        s = ReasoningSplitter(thinking)
        got = [s.feed(c) for c in chunks] + [s.finish()]
        assert ("".join(r for r, _ in got), "".join(c for _, c in got)) == (reasoning, content)
    s = ReasoningSplitter(True)
    assert s.feed("abc</th") == ("abc", "") and s.feed("ink>de") == ("", "de")   # held back inside the marker


ONE = f'Checking.\n\n<{D}tool_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>'


def test_tool_calls_single_parallel_and_malformed():
    content, calls = parse_tool_calls(ONE)
    assert content == "Checking." and [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})] and calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    content, calls = parse_tool_calls(CALLS)
    assert content == "" and [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}, {"city": "Tokyo", "days": 2}]
    assert len(parse_tool_calls(CALLS, max_calls=1)[1]) == 1                                 # parallel_tool_calls: false
    bad = [ONE.replace('string="true"', 'string="maybe"'),                                   # unknown flag
           ONE.replace(">Paris<", ">Paris").replace(f"</{D}parameter>", ""),                 # parameter never closed
           ONE.replace('string="true">Paris', 'string="false">Paris'),                       # not JSON
           ONE.replace(f"</{D}invoke>", "oops"),                                              # stray text
           ONE[:ONE.index(f"</{D}invoke>")]]                                                 # cut inside a call
    for text in bad: assert parse_tool_calls(text) == (text, []), text
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    assert parse_tool_calls(ONE[:-len(f"</{D}tool_calls>")])[1]                               # only the close missing


def chunks_of(stream: ChatStream, pieces_, finish="stop") -> list[dict]:
    "The chat.completion.chunk dicts the server sends for these text pieces."
    out = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    for k, p in enumerate(pieces_):
        done = k == len(pieces_) - 1
        delta = stream.step(p, done)
        if delta or done:
            out.append({"index": 0, "delta": delta, "finish_reason": stream.finish_reason(finish) if done else None})
    return [{"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [c]} for c in out]


def test_streamed_tool_calls_reassemble_in_the_openai_client():
    reply = "I should look it up.</think>" + CALLS
    whole = ChatStream(True, True).message(reply)
    state = ChatCompletionStreamState()
    for c in chunks_of(ChatStream(True, True), pieces(reply) + [""]):
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    got = [(t.function.name, json.loads(t.function.arguments)) for t in final.message.tool_calls]
    assert got == [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in whole["tool_calls"]]
    assert final.message.reasoning_content == whole["reasoning_content"] == "I should look it up."
    # malformed text streams through as content, never an exception
    s, text = ChatStream(None, True), ONE.replace(f"</{D}invoke>", "oops")
    deltas = [s.step(p, k == len(pieces(text)) - 1) for k, p in enumerate(pieces(text))]
    assert "".join(d.get("content", "") for d in deltas).endswith("oops\n</｜DSML｜tool_calls>") and s.tools.malformed


def test_fragments_parser_keeps_ids_and_indices():
    p = ToolCallParser()
    frags = [f for ch in CALLS for f in p.feed(ch)[1]] + p.finish()[1]
    heads = [f for f in frags if "id" in f]
    assert [h["index"] for h in heads] == [0, 1] and all(h["function"]["arguments"] == "" for h in heads)
    for i in (0, 1):
        args = "".join(f["function"]["arguments"] for f in frags if f["index"] == i)
        assert args == p.tool_calls()[i]["function"]["arguments"]


TINY = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def servers(tiny_ckpt, tmp_path_factory):
    "The tiny checkpoint as shipped (its Jinja template), and a copy without one: DeepSeek-V4's encoding."
    v4 = tmp_path_factory.mktemp("v4ckpt") / "tiny-v4"
    shutil.copytree(tiny_ckpt, v4)
    cfg = json.loads((v4 / "tokenizer_config.json").read_text()); cfg.pop("chat_template")
    (v4 / "tokenizer_config.json").write_text(json.dumps(cfg))
    mc = json.loads((v4 / "config.json").read_text()); mc["max_position_embeddings"] = 2048   # room for a tool round trip
    (v4 / "config.json").write_text(json.dumps(mc))
    args = ["--kv-cache-memory-bytes", str(64 * 2**20), "--max-num-seqs", "4", "--speculative", "none"]
    s1 = start_server(["--model", str(tiny_ckpt), "--max-model-len", "1024", *args], tmp_path_factory.mktemp("jinja"))
    try: s2 = start_server(["--model", str(v4), "--max-model-len", "2048", *args,
                            "--default-chat-template-kwargs", '{"thinking": true}'], tmp_path_factory.mktemp("v4"))
    except Exception: s1.stop(); raise
    yield s1, s2
    s1.stop(); s2.stop()


def test_server_accepts_tools_and_template_kwargs(servers):
    for s in servers:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Weather?"}]                    # the tools section alone is long
        r = c.chat.completions.create(model=c.models.list().data[0].id, messages=msgs, tools=[TINY], tool_choice="auto",
                                      max_tokens=8, temperature=0, extra_body={"chat_template_kwargs": {"thinking": True}})
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        stream = c.chat.completions.create(model=r.model, messages=msgs, tools=[TINY], max_tokens=8, stream=True,
                                           stream_options={"include_usage": True}, reasoning_effort="high")
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 8
        forced = c.chat.completions.create(model=r.model, messages=msgs, tools=[TINY], tool_choice="required",
                                           max_tokens=200, temperature=0)      # the grammar forces a call (chapter 02b)
        assert forced.choices[0].finish_reason == "tool_calls", forced.choices[0]
        assert forced.choices[0].message.tool_calls[0].function.name == TINY["function"]["name"]
        bad = httpx.post(s.url + "/v1/chat/completions", json={"messages": msgs, "chat_template_kwargs": {"bogus": 1}})
        assert bad.status_code == 400 and "bogus" in bad.json()["error"]["message"]
        fn = lambda **f: {"type": "function", "function": f}
        for tools, says in (([fn(name='say "hi"')], "pattern"), ([fn(name="f", parameters={"type": "nonsense"})], "object schema"),
                            ([fn(name="f"), fn(name="f")], "duplicate"), ([fn(name="f", parameters={"properties": {"a": 1}})], "schemas"),
                            ([fn(name="f", parameters={"properties": {"a": {"type": "nope"}}})], "parameter 'a' of 'f': Invalid type")):
            bad = httpx.post(s.url + "/v1/chat/completions", json={"messages": msgs, "tools": tools, "tool_choice": "required"})
            assert bad.status_code == 400 and says in bad.json()["error"]["message"], bad.text
    jinja, v4 = servers
    r = httpx.post(v4.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                                                          "temperature": 0}, timeout=120).json()
    assert "reasoning_content" in r["choices"][0]["message"]                # thinking on by the server's default
    assert "reasoning_tokens" in r["usage"]["completion_tokens_details"]
    r = httpx.post(jinja.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).json()
    assert "reasoning_content" not in r["choices"][0]["message"]            # the Jinja model: no reasoning parser by default


def test_langchain_tools_and_structured_output(servers):
    "LangChain as agents use it: `bind_tools` and a tool round trip, and `with_structured_output(PydanticModel)`."
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from pydantic import BaseModel
    s = servers[1]                                                       # the V4 encoding renders tools and results
    name = openai.OpenAI(base_url=s.url + "/v1", api_key="x").models.list().data[0].id
    llm = lc.ChatOpenAI(model=name, base_url=s.url + "/v1", api_key="x", temperature=0, max_tokens=300,
                        max_retries=0, timeout=120)

    def get_weather(unit: Literal["celsius", "fahrenheit"]) -> str:
        "Today's temperature in the given unit."
        return "21"

    msgs = [HumanMessage("Temperature?")]
    ai = llm.bind_tools([get_weather], tool_choice="required").invoke(msgs)   # forced by the tool-call grammar
    assert ai.response_metadata["finish_reason"] == "tool_calls" and ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"]["unit"] in ("celsius", "fahrenheit")
    msgs += [ai, ToolMessage("21", tool_call_id=ai.tool_calls[0]["id"])]
    reply = llm.bind_tools([get_weather]).invoke(msgs)                         # the result goes back through the encoding
    assert reply.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")

    class Verdict(BaseModel):
        warm: bool
        unit: Literal["celsius", "fahrenheit"]

    out = llm.with_structured_output(Verdict, method="json_schema").invoke("Is it warm? Answer as JSON.")
    assert isinstance(out, Verdict)
