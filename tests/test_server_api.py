"""End to end: a real uvicorn server (in a thread, 127.0.0.1, free port) over the tiny artifact's
Engine, driven by the real `openai` client and raw httpx. Plus a scripted engine (fixed token
script, same manifest) for tool calls and reasoning, and `onegraph serve` under SIGTERM."""
import asyncio
import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest

from onegraph.runtime import Engine, Event, QueueFull  # noqa: F401
from onegraph.server.app import create_app
from server_helpers import running  # noqa: E402
from onegraph.runtime.codec import TextCodec

MODEL = "tiny-test"
MSGS = [{"role": "user", "content": "Hello there, who are you?"}]




@pytest.fixture(scope="module")
def engine(tiny_artifact):
    eng = Engine.from_artifact(tiny_artifact, max_slots=4, max_queue=64, check_parity=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def codec(tiny_artifact):
    return TextCodec.from_artifact(tiny_artifact)


@pytest.fixture(scope="module")
def base(engine):
    with running(create_app(engine, MODEL)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat_ids(codec, msgs=MSGS):
    return codec.encode(codec.render_chat(msgs))


def metric(base, name):
    text = httpx.get(base + "/metrics").text
    m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1))


def err(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


# ---------------------------------------------------------------- happy paths
def test_models_and_health(base, client):
    assert httpx.get(base + "/health").json()["status"] == "ok"
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_stream_usage_exact(client, codec, engine):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=12, temperature=0,
                                       extra_body={"return_token_ids": True})
    ch = r.choices[0]
    ids = chat_ids(codec)
    assert r.usage.prompt_tokens == len(ids)
    want = engine.generate(ids, max_new_tokens=12, temperature=0.0, stop_ids=engine.ex.manifest["model"]["eos_token_ids"])
    assert ch.model_extra["token_ids"] == want.token_ids
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(ids) + len(want.token_ids)
    assert ch.finish_reason == {"stop": "stop", "length": "length"}[want.finish_reason]
    assert ch.message.role == "assistant" and isinstance(ch.message.content, str)


def test_chat_stream_matches_non_stream(client):
    kw = dict(model=MODEL, messages=MSGS, max_tokens=16, temperature=0.8, seed=11)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert text == (full.choices[0].message.content or "")
    assert reasoning.rstrip("\n") == (getattr(full.choices[0].message, "reasoning_content", None) or "")
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_seeded_equals_engine_generate(client, codec, engine):
    prompt = "Once upon a time"
    ids = codec.encode(prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.8, seed=1234,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    want = engine.generate(ids, max_new_tokens=20, temperature=0.8, seed=1234)
    assert r.choices[0].model_extra["token_ids"] == want.token_ids
    assert r.choices[0].text == codec.decode(want.token_ids)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 20)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0.8, seed=1234,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == r.choices[0].text
    # token-id prompts work too
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0.8, seed=1234,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == r.choices[0].text


def test_n2_seeds_follow(client, codec, engine):
    ids = codec.encode("abc")
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=1.0, seed=7, n=2,
                                  extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    for i, c in enumerate(r.choices):
        assert c.model_extra["token_ids"] == engine.generate(ids, 10, temperature=1.0, seed=7 + i).token_ids
    assert r.usage.completion_tokens == 20 and r.usage.prompt_tokens == len(ids)
    # streamed n=2: both indices finish
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=10, temperature=1.0, seed=7, n=2,
                                            stream=True, extra_body={"ignore_eos": True}))
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts == [c.text for c in r.choices]


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt="The", max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    # a stop string that first occurs mid-output, spanning several byte tokens
    k = next(k for k in range(3, len(base) - 3) if base.find(base[k:k + 3]) == k and "\ufffd" not in base[k:k + 3])
    stop = base[k:k + 3]
    r = client.completions.create(model=MODEL, prompt="The", max_tokens=40, temperature=0, stop=[stop, "\x00zz"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[:k]
    assert r.usage.completion_tokens < 40
    chunks = list(client.completions.create(model=MODEL, prompt="The", max_tokens=40, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == base[:k]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_truncation_and_default(client, codec):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    # no max_tokens: generate what fits (capped) — here until the context is full
    long_prompt = "x" * 240
    r = client.completions.create(model=MODEL, prompt=long_prompt, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 256 - len(codec.encode(long_prompt))
    assert r.choices[0].finish_reason == "length"


# ---------------------------------------------------------------- errors
@pytest.mark.parametrize("body,param", [
    ("{not json", None),
    ("[1, 2]", None),
    ('{"model": "tiny-test"}', "messages"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "response_format": '
     '{"type": "json_object"}}', "response_format"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "temperature": 9}', "temperature"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_tokens"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}', "max_tokens"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}', "max_tokens"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}', "top_p"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "n": 0}', "n"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "seed": 1e30}', "seed"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "logprobs": true}', "logprobs"),
    ('{"model": "tiny-test", "messages": [{"role": "robot", "content": "hi"}]}', "messages.0.role"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "stop": 5}', "stop"),
    ('{"model": "tiny-test", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}',
     "tool_choice"),
])
def test_bad_requests_400(base, body, param):
    e = err(httpx.post(base + "/v1/chat/completions", content=body), 400)
    if param:
        assert (e["param"] or "").startswith(param), e


def test_bad_completion_requests_400(base):
    post = lambda **b: httpx.post(base + "/v1/completions", json={"model": MODEL, **b})  # noqa: E731
    err(post(prompt=""), 400)
    err(post(prompt=[1, 2, 99999]), 400)
    err(post(prompt="x" * 300), 400)                           # prompt beyond max_seq_len
    assert err(post(prompt="hi", logprobs=3), 400)["message"].endswith("not supported by this server")
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0).completions.create(
            model=MODEL, prompt="hi", max_tokens=10_000)


def test_unknown_route_is_openai_shaped(base):
    err(httpx.get(base + "/v1/nothing"), 404)


def test_api_key_401(engine):
    with running(create_app(engine, MODEL, api_key="sekret")) as url:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        err(httpx.post(url + "/v1/completions", json=body), 401)
        err(httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}), 401)
        err(httpx.get(url + "/v1/models"), 401)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert ok.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(url + "/health").status_code == 200             # health and metrics stay open


def test_queue_full_503(engine):
    # a second Engine over the same executor, no queue and every slot taken: every submit is refused
    # before it reaches the engine thread, so it never touches the shared executor
    full = Engine(engine.ex, max_queue=0)
    with full.cv:
        full.free.clear()
    try:
        with running(create_app(full, MODEL)) as url:
            r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS, "stream": True})
            e = err(r, 503)
            assert e["code"] == "queue_full" and int(r.headers["retry-after"]) >= 1
            with pytest.raises(openai.InternalServerError):
                openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
                    model=MODEL, prompt="hi", max_tokens=2, n=2)
            assert 'onegraph_requests_total{endpoint="/v1/chat/completions",status="503"} 1.0' in \
                httpx.get(url + "/metrics").text
    finally:
        full.close()


class _Broken:
    """An engine whose submit hits a bug: the request fails with 500, the server lives on."""

    def __init__(self, real):
        self.artifact, self.real = real.artifact, real

    def submit(self, *a, **k):
        raise KeyError("boom")

    def cancel(self, rid):
        return False

    def stats(self):
        return self.real.stats()


def test_unexpected_exception_500_server_stays_healthy(engine):
    with running(create_app(_Broken(engine), MODEL)) as url:
        e = err(httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}), 500)
        assert e["type"] == "server_error"
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert httpx.get(url + "/v1/models").status_code == 200


def test_disconnect_mid_stream_frees_slot(base, engine):
    before = engine.stats()["counters"].get("finished_cancelled", 0)
    body = {"model": MODEL, "prompt": "go", "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", base + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(x.startswith("data: {") for x in got)
            assert metric(base, "onegraph_active_slots") >= 1
    t0 = time.time()
    while metric(base, "onegraph_active_slots") != 0:
        assert time.time() - t0 < 15, "slot not freed after the client went away"
        time.sleep(0.05)
    assert engine.stats()["counters"].get("finished_cancelled", 0) > before


def test_32_concurrent_streams(base, codec):
    async def one(cl, i):
        stream = await cl.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"client {i}"}], max_tokens=8, temperature=0.5,
            seed=i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        finish, usage, n_chunks = None, None, 0
        async for ch in stream:
            if ch.choices and ch.choices[0].finish_reason:
                finish = ch.choices[0].finish_reason
            if ch.usage:
                usage = ch.usage
            n_chunks += 1
        return i, finish, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120) as cl:
            return await asyncio.gather(*(one(cl, i) for i in range(32)))

    for i, finish, usage in asyncio.run(main()):
        assert finish == "length"
        assert usage.completion_tokens == 8
        assert usage.prompt_tokens == len(chat_ids(codec, [{"role": "user", "content": f"client {i}"}]))
    assert metric(base, "onegraph_active_slots") == 0


# ---------------------------------------------------------------- scripted engine: tools and reasoning
class ScriptedEngine:
    """Emits a fixed text's token ids (on a thread, like the real engine), then "stop"."""

    def __init__(self, real, codec, script):
        self.artifact, self.codec, self.script = real.artifact, codec, script
        self.active = 0

    def submit(self, prompt_ids, emit, max_new_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=None,
               stop_ids=()):
        ids = self.codec.encode(self.script)[:max_new_tokens]

        def run():
            for t in ids:
                emit(Event(t))
            emit(Event(None, "stop" if len(ids) < max_new_tokens else "length"))
        threading.Thread(target=run, daemon=True).start()
        return 1

    def cancel(self, rid):
        return False

    def stats(self):
        return {"active_slots": 0, "free_slots": 1, "queue_depth": 0, "max_slots": 1, "error": None}


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
SCRIPT = ("<think>\nThe user wants weather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


def test_tool_calls_and_reasoning_end_to_end(engine, codec):
    with running(create_app(ScriptedEngine(engine, codec, SCRIPT), MODEL)) as url:
        cl = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS, max_tokens=150)
        r = cl.chat.completions.create(**kw)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls"
        assert ch.message.content == "Checking."
        assert ch.message.model_extra["reasoning_content"] == "The user wants weather."
        (call,) = ch.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
        assert r.usage.completion_tokens == len(codec.encode(SCRIPT))

        chunks = list(cl.chat.completions.create(**kw, stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        calls = [tc for d in deltas for tc in (d.tool_calls or [])]
        # name first, then the arguments in pieces as they generate
        assert calls[0].index == 0 and calls[0].function.name == "get_weather" and len(calls) > 2
        assert all(c.index == 0 and c.id is None and c.function.name is None for c in calls[1:])
        assert json.loads("".join(c.function.arguments for c in calls)) == {"city": "Paris", "days": 2}
        assert "".join(d.content or "" for d in deltas) == "Checking."
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas).strip() == "The user wants weather."
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # tool_choice none: no parsing, the XML stays content; a follow-up turn with the tool result renders
        r = cl.chat.completions.create(**kw, tool_choice="none")
        assert r.choices[0].finish_reason == "stop" and "<tool_call>" in r.choices[0].message.content
        follow = kw["messages"] + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
        assert cl.chat.completions.create(**{**kw, "messages": follow}).choices[0].finish_reason == "tool_calls"


def test_not_a_call_is_content(engine, codec):
    bad = "Sure <tool_call>\n<function={{ name }}>\n</function>\n</tool_call>"
    with running(create_app(ScriptedEngine(engine, codec, bad), MODEL)) as url:
        cl = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        r = cl.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=100)
        assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == bad
        assert not r.choices[0].message.tool_calls


def test_cut_call_says_length_and_call_in_think_says_tool_calls(engine, codec):
    # cut by max_tokens inside a value: the call was already streamed; it stays, finish_reason "length"
    cut = "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nParis and more words that get cut"
    n = len(codec.encode(cut)) - 3
    # Qwen3.5/3.6 may write the call inside <think>: it is a call, finish_reason "tool_calls"
    think = ("<think>\nLet me look.\n<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n"
             "</function>\n</tool_call>\n</think>\n\n")
    for script, kw, finish in [(cut, {"max_tokens": n}, "length"), (think, {}, "tool_calls")]:
        with running(create_app(ScriptedEngine(engine, codec, script), MODEL)) as url:
            cl = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
            r = cl.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, **kw)
            assert r.choices[0].finish_reason == finish
            (call,) = r.choices[0].message.tool_calls
            chunks = list(cl.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, stream=True, **kw))
            deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            assert chunks[-1].choices[0].finish_reason == finish
            assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
            assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
            if finish == "length":       # the value streamed token by token, before the cut
                assert r.choices[0].message.content == "Sure" and len(deltas) > 3
                assert json.loads(call.function.arguments)["city"].startswith("Paris and")
    assert json.loads(call.function.arguments) == {"days": 2}
    assert r.choices[0].message.model_extra["reasoning_content"] == "Let me look."


# ---------------------------------------------------------------- the CLI under SIGTERM
def test_serve_cli_sigterm_cancels_and_exits_0(tiny_artifact):
    from tp_helpers import launch_serve
    proc, url = launch_serve(tiny_artifact, "--max-slots", 2, model=MODEL)
    try:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 240, "stream": True, "ignore_eos": True}
        with httpx.Client(timeout=30) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            rest = [x for x in lines if x]           # the stream ends: cancelled in flight
        assert rest[-1] == "data: [DONE]"
        assert any('"cancelled"' in x for x in rest[-2:]), rest[-3:]
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- input bounds (server/limits.py)
def test_unknown_model_is_404_model_not_found(base, client):
    e = err(httpx.post(base + "/v1/chat/completions", json={"model": "nope", "messages": MSGS}), 404)
    assert e["code"] == "model_not_found" and e["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)


def test_response_format_other_than_text_is_refused(base):
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 2, "temperature": 0}
    e = err(httpx.post(base + "/v1/chat/completions", json={**body, "response_format": {"type": "json_schema"}}), 400)
    assert e["param"] == "response_format" and "json_schema" in e["message"]
    r = httpx.post(base + "/v1/chat/completions", json={**body, "response_format": {"type": "text"}}, timeout=60)
    assert r.status_code == 200, r.text


def test_body_over_the_limit_is_413_before_parsing(engine, base):
    big = b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}'       # 5 MB: over the 4 MiB default
    t0 = time.perf_counter()
    e = err(httpx.post(base + "/v1/completions", content=big, timeout=30), 413)
    assert e["code"] == "request_too_large" and time.perf_counter() - t0 < 2
    with running(create_app(engine, MODEL, max_request_bytes=200)) as url:
        ok = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        assert httpx.post(url + "/v1/completions", json=ok, timeout=60).status_code == 200
        chunks = iter([json.dumps({**ok, "prompt": "y" * 150}).encode()[:120], b" " * 100])
        assert err(httpx.post(url + "/v1/completions", content=chunks), 413)["code"] == "request_too_large"


def test_tokenizing_a_large_prompt_leaves_health_responsive(engine, codec):
    """A large prompt's tokenizing runs in a worker thread: here it is held until /health has answered,
    which it could not do if the tokenizing held the event loop."""
    gate = threading.Event()

    class Gated:
        def __getattr__(self, name):
            return getattr(codec, name)

        def encode(self, text):
            if len(text) > 10_000:
                assert gate.wait(20), "/health never answered while the prompt was tokenized"
            return codec.encode(text)

    with running(create_app(engine, MODEL, codec=Gated())) as url:
        done = []
        th = threading.Thread(target=lambda: done.append(httpx.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": "ab " * 100_000}, timeout=60)))
        th.start()
        time.sleep(0.2)                                              # the big request is in encode, held
        assert httpx.get(url + "/health", timeout=5).json()["status"] == "ok"
        gate.set()
        th.join(60)
        assert done and done[0].status_code == 400                   # beyond max_seq_len, after tokenizing
