"""Engine isolation (issue 43, item 1) and stop strings at scale (item 4): a step that raises fails only the requests
it can be pinned to and the engine goes on; an engine that keeps failing declares itself broken and the server
process exits non-zero. The failure is injected through the engine's documented test hook (`DSPARK_TEST_FAULT`,
`EngineCore.fault`), which runs where the model runner does; everything else is the shipped engine and server."""
from __future__ import annotations

import json
import random
import threading
import time

import httpx
import pytest

import dspark
from dspark.engine.core import EngineBroken, step_fault
from dspark.engine.outputs import StopMatcher
from dspark.sample.sampling import SamplingParams
from serving import start_server

MAX_LEN = 128
KV = 16 * 2**20
PROMPTS = ["Beautiful is better than", "Simple is", "In the face of ambiguity", "Now is better than never"]
POISON = 7                                              # a token id: a request whose prompt holds it makes a step raise
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return dspark.LLM(tiny_ckpt, speculative="dspark", num_speculative_tokens=3, max_model_len=MAX_LEN,
                      kv_cache_memory_bytes=KV, max_num_seqs=8)


@pytest.fixture(scope="module")
def ref(llm):
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(POISON not in o.prompt_token_ids for o in outs)
    return {p: o.outputs[0] for p, o in zip(PROMPTS, outs)}


def run_all(llm, rids):
    "Step until every request finished; each request's deltas."
    deltas = {r: [] for r in rids}
    while llm.has_unfinished_requests():
        for d in llm.step(): deltas[d.request_id].append(d)
    return deltas


def test_poisoned_request_fails_alone_and_the_engine_goes_on(llm, ref):
    free0 = llm.scheduler.kv.comp.num_free
    llm.engine.fault = step_fault(f"token:{POISON}")
    try:
        rids = [llm.add_request(p, GREEDY) for p in PROMPTS[:2]]
        bad = llm.add_request([3, POISON, 5, 9], GREEDY)              # in the same first step as the healthy ones
        rids += [llm.add_request(p, GREEDY) for p in PROMPTS[2:]]
        deltas = run_all(llm, rids + [bad])
        outs = {r: llm.pop_output(r) for r in rids + [bad]}
        last = deltas[bad][-1]
        assert last.finish_reason == "error" and "injected step failure" in last.error
        assert outs[bad].outputs[0].finish_reason == "error"
        for r, p in zip(rids, PROMPTS):
            o = outs[r].outputs[0]
            assert (o.token_ids, o.text, o.finish_reason) == (ref[p].token_ids, ref[p].text, ref[p].finish_reason)
        assert llm.scheduler.kv.comp.num_free == free0                # the failed request's blocks came back
        late = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)      # later requests work, the hook still armed
        assert late[0].outputs[0].token_ids == ref[PROMPTS[0]].token_ids
    finally:
        llm.engine.fault = None


def test_every_step_failing_breaks_the_engine(llm):
    llm.engine.fault = step_fault("always")
    try:
        failed = 0
        with pytest.raises(EngineBroken, match="steps in a row"):
            for _ in range(llm.engine.MAX_FAILED_STEPS + 1):
                rid = llm.add_request("Simple is", GREEDY)
                d = run_all(llm, [rid])[rid]
                assert d[-1].finish_reason == "error"; llm.pop_output(rid); failed += 1
        assert failed == llm.engine.MAX_FAILED_STEPS - 1                # the last failure is the engine's
    finally:
        llm.engine.fault = None
        for r in [*llm.scheduler.running, *llm.scheduler.waiting]: llm.abort_request(r.request_id)


def plain_cut(text, sent, stops):
    "The reference: every stop string searched in its window, in list order (the matcher the engine had)."
    for s in stops:
        if s in text[max(0, sent - len(s)):]: return text.index(s, max(0, sent - len(s)))
    return None


def test_stop_matcher_equals_the_plain_one():
    rng = random.Random(1)
    for _ in range(300):
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 40))]
        text = "".join(rng.choice("abc d") for _ in range(rng.randint(0, 30)))
        sent = rng.randint(0, len(text))
        assert StopMatcher(stops).find(text, sent) == plain_cut(text, sent, stops)


def test_ten_thousand_stop_strings(llm):
    """10k stop strings — near misses of the text, random strings, and the one that occurs listed last — give the
    text the plain matcher gives, streamed and whole."""
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    full = llm.generate(["Errors should never pass silently"], sp, use_tqdm=False)[0].outputs[0].text
    assert len(full) > 24
    rng = random.Random(0)
    near = [full[i:i + k] + "\x01" for i in range(len(full)) for k in (1, 3, 7)]
    noise = ["".join(rng.choice("xyzqj\x02") for _ in range(rng.randint(1, 12))) for _ in range(10_000)]
    stops = [s for s in near + noise if s not in full][:9_999] + [full[20:24]]
    assert len(stops) == 10_000
    want = full[: plain_cut(full, 0, stops)]
    rid = llm.add_request("Errors should never pass silently", SamplingParams(temperature=0.0, max_tokens=32,
                                                                               ignore_eos=True, stop=stops))
    deltas = run_all(llm, [rid])[rid]
    out = llm.pop_output(rid).outputs[0]
    assert out.text == want and out.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == want


# --- the real server ----------------------------------------------------------------------------------------------
ARGS = ["--max-model-len", str(MAX_LEN), "--kv-cache-memory-bytes", str(KV), "--max-num-seqs", "8",
        "--num-speculative-tokens", "3", "--served-model-name", "tiny", "--exit-grace", "2"]


def test_server_poisoned_request_gets_500_others_finish(tiny_ckpt, tmp_path, ref):
    s = start_server(["--model", str(tiny_ckpt), *ARGS], tmp_path, env={"DSPARK_TEST_FAULT": f"token:{POISON}"})
    try:
        url = s.url + "/v1/completions"
        got = {}
        def healthy(p):
            got[p] = httpx.post(url, json={"prompt": p, "max_tokens": 12, "temperature": 0}, timeout=120)
        def poisoned_stream():
            with httpx.stream("POST", url, json={"prompt": [3, POISON, 5], "max_tokens": 12, "stream": True},
                              timeout=120) as r:
                got["stream"] = [line for line in r.iter_lines() if line]
        threads = [threading.Thread(target=healthy, args=(p,)) for p in PROMPTS] + [threading.Thread(target=poisoned_stream)]
        for t in threads: t.start()
        bad = httpx.post(url, json={"prompt": [POISON, 4], "max_tokens": 12}, timeout=120)
        for t in threads: t.join()
        assert bad.status_code == 500 and "injected step failure" in bad.json()["error"]["message"]
        frames = got["stream"]
        assert frames[-1] == "data: [DONE]" and json.loads(frames[-2][6:])["error"]["code"] == 500
        for p in PROMPTS:
            assert got[p].status_code == 200 and got[p].json()["choices"][0]["text"] == ref[p].text
        assert httpx.get(s.url + "/health").status_code == 200
        later = httpx.post(url, json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}, timeout=120)
        assert later.status_code == 200 and later.json()["choices"][0]["text"] == ref[PROMPTS[0]].text
        assert s.proc.poll() is None
    finally:
        s.stop()


def test_server_exits_non_zero_when_the_engine_breaks(tiny_ckpt, tmp_path):
    s = start_server(["--model", str(tiny_ckpt), *ARGS], tmp_path, env={"DSPARK_TEST_FAULT": "always"})
    try:
        codes, health = [], []
        for _ in range(10):                                        # every request fails; the engine gives up
            try: r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
            except httpx.TransportError: break
            codes.append(r.status_code)
            try: health.append(httpx.get(s.url + "/health", timeout=5))
            except httpx.TransportError: break
            if health[-1].status_code != 200: break               # broken: it says so until the process is gone
        t0 = time.monotonic()
        rc = s.proc.wait(30)
        assert rc == 70, s.output()
        assert codes == [500] * s_max_failed()                     # the last failure broke the engine
        assert [h.status_code for h in health[:-1]] == [200] * (len(health) - 1)
        if len(health) == len(codes):                              # the probe after the break came before the exit
            assert health[-1].status_code == 503 and health[-1].json()["status"] == "broken"
        print(f"exit {rc} {time.monotonic() - t0:.1f} s after the last answer; statuses {codes}")
    finally:
        s.stop()


def s_max_failed() -> int:
    from dspark.engine.core import EngineCore
    return EngineCore.MAX_FAILED_STEPS
