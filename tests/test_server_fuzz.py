"""Hypothesis over request bodies (wrong types, out-of-range and huge values, odd unicode, random
JSON): the server answers 200 or a 4xx/503 with an OpenAI-shaped error body — never a 500 — and
/health is OK afterwards."""
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onegraph.runtime import Engine
from onegraph.server.app import create_app
from server_helpers import running  # noqa: E402

MODEL = "fuzz"




@pytest.fixture(scope="module")
def base(tiny_artifact):
    eng = Engine.from_artifact(tiny_artifact, max_slots=4, max_queue=64, check_parity=False)
    with running(create_app(eng, MODEL), "critical") as url:
        yield url
    eng.close()


@pytest.fixture(scope="module")
def http(base):
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c


json_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                      st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
anything = st.recursive(json_leaf, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                                                            max_size=3), max_leaves=8)
small_int = st.one_of(st.integers(min_value=-3, max_value=40), st.integers(min_value=-(2 ** 80), max_value=2 ** 80))
num = st.one_of(st.floats(allow_nan=False, allow_infinity=False), st.integers(-5, 5), st.floats(0, 1))
unicode_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)   # surrogates can't be UTF-8 encoded
message = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), anything),
     "content": st.one_of(unicode_text, st.none(), st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": unicode_text}), max_size=2), anything)})
common = {
    "model": st.one_of(st.just(MODEL), anything),
    "max_tokens": st.one_of(small_int, anything),
    "temperature": st.one_of(num, anything),
    "top_p": st.one_of(num, anything),
    "top_k": st.one_of(small_int, anything),
    "seed": st.one_of(small_int, anything),
    "n": st.one_of(st.integers(-1, 3), anything),
    "stop": st.one_of(unicode_text, st.lists(unicode_text, max_size=20), anything),
    "stream": st.one_of(st.booleans(), anything),
    "logprobs": st.one_of(st.booleans(), anything),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), anything),
}


def some_of(fields: dict):
    return st.fixed_dictionaries({}, optional=fields)


chat_body = st.tuples(some_of(common), some_of({
    "messages": st.one_of(st.lists(message, min_size=0, max_size=3), anything),
    "tools": st.one_of(st.just([{"type": "function", "function": {"name": "f", "parameters": {}}}]), anything),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), anything),
    "max_completion_tokens": st.one_of(small_int, anything),
})).map(lambda t: {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **t[0], **t[1]})
completion_body = st.tuples(some_of(common), some_of({
    "prompt": st.one_of(unicode_text, st.lists(st.integers(-5, 300), max_size=5), st.lists(unicode_text, max_size=2),
                        anything),
    "echo": st.one_of(st.booleans(), anything),
})).map(lambda t: {"model": MODEL, "prompt": "hi", "max_tokens": 4, **t[0], **t[1]})


def check(http, path, payload):
    r = http.post(path, content=payload, headers={"content-type": "application/json"})
    assert r.status_code != 500 and r.status_code < 500 or r.status_code == 503, (r.status_code, r.text[:300], payload)
    if r.status_code == 200:
        if r.headers["content-type"].startswith("text/event-stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert "choices" in r.json()
    else:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)


@SETTINGS
@given(body=chat_body)
def test_fuzz_chat(http, body):
    check(http, "/v1/chat/completions", json.dumps(body).encode())


@SETTINGS
@given(body=completion_body)
def test_fuzz_completions(http, body):
    check(http, "/v1/completions", json.dumps(body).encode())


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(raw=st.one_of(st.binary(max_size=64), anything.map(lambda x: json.dumps(x).encode()),
                     st.text(max_size=30).map(lambda s: ('{"model": "fuzz", "prompt": "%s"}' % s).encode("utf-8",
                                                                                                      "surrogatepass"))))
def test_fuzz_raw_bytes(http, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check(http, path, raw)


def test_health_after_fuzz(http):
    assert http.get("/health").json()["status"] == "ok"
    assert 'status="500"' not in http.get("/metrics").text
