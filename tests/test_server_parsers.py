"""Server text machinery on scripted outputs: tool-call and reasoning parsers (complete, streamed in
pieces of every size, malformed) and the stop-string matcher across token boundaries."""
import json

import pytest

from onegraph.server.parsers import (ReasoningParser, ToolCallParser, convert_value, parse_tool_calls,
                                     split_reasoning, tool_schemas)
from onegraph.server.stops import StopMatcher

WEATHER_TOOLS = tool_schemas([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "extra": {"type": "object"}}}}}])

ONE_CALL = ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
TWO_CALLS = ONE_CALL + ("\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York, NY\n</parameter>\n"
                        "<parameter=metric>\ntrue\n</parameter>\n<parameter=extra>\n{\"a\": [1, 2]}\n</parameter>\n"
                        "</function>\n</tool_call>\n")


def pieces(text, size):
    return [text[i:i + size] for i in range(0, len(text), size)]


def stream_tools(text, size, tools=WEATHER_TOOLS):
    p = ToolCallParser(tools)
    parts = []
    for d in pieces(text, size):
        parts += p.feed(d)
    parts += p.finish()
    content = "".join(x for k, x in parts if k == "content")
    calls = [x for k, x in parts if k == "tool_call"]
    return content or None, calls


def test_tool_call_complete():
    content, calls = parse_tool_calls(ONE_CALL, WEATHER_TOOLS)
    assert content == "Let me check."
    assert len(calls) == 1 and calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_two_tool_calls_typed_by_schema():
    content, calls = parse_tool_calls(TWO_CALLS, WEATHER_TOOLS)
    assert content == "Let me check."
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [
        {"city": "Paris", "days": 3}, {"city": "New York, NY", "metric": True, "extra": {"a": [1, 2]}}]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7, 11, 64, 10_000])
def test_tool_calls_streamed_in_pieces_match_complete(size):
    want_content, want = parse_tool_calls(TWO_CALLS, WEATHER_TOOLS)
    content, calls = stream_tools(TWO_CALLS, size)
    assert content == want_content
    assert [(c["index"], c["function"]) for c in calls] == [(i, c["function"]) for i, c in enumerate(want)]


def test_no_tool_call_passes_text_through_exactly():
    text = "plain answer with <tool and <tool_cal but no call  \n\n"
    for size in (1, 4, 100):
        assert stream_tools(text, size) == (text, [])


@pytest.mark.parametrize("text", [
    "before <tool_call>\n<function=get_weather>\n<parameter=city>\nPa",                 # unclosed (length cut)
    "x <tool_call>no function here</tool_call> y",                                       # no <function=>
    "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>junk\n</function>\n</tool_call>",  # junk
    "<tool_call><function=>\n</function></tool_call>",                                   # empty name
    "<tool_call>\n<function=f>\n<parameter=a>1</function>\n</tool_call>",                # unclosed parameter
])
def test_malformed_tool_call_degrades_to_content(text):
    for size in (1, 3, 1000):
        content, calls = stream_tools(text, size)
        assert calls == []
        assert content == text


def test_untyped_parameters_and_text_after_call():
    text = "<tool_call>\n<function=f>\n<parameter=n>\n42\n</parameter>\n<parameter=s>\nhi there\n</parameter>\n" \
           "</function>\n</tool_call>\nDone."
    content, calls = parse_tool_calls(text, {})
    assert json.loads(calls[0]["function"]["arguments"]) == {"n": 42, "s": "hi there"}
    assert content == "Done."


def test_convert_value():
    assert convert_value("3.5", {"type": "number"}) == 3.5
    assert convert_value("7", {"type": ["integer", "null"]}) == 7
    assert convert_value("seven", {"type": "integer"}) == "seven"       # wrong type: keep the text
    assert convert_value("[1,2]", {"type": "array"}) == [1, 2]
    assert convert_value("007", {"type": "string"}) == "007"
    assert convert_value("null", {"type": ["string", "null"]}) == "null"


THOUGHT = "<think>\nthe user wants x\nso y\n</think>\n\nThe answer is 4."


def stream_reasoning(text, size, in_think=False):
    p = ReasoningParser(in_think)
    parts = []
    for d in pieces(text, size):
        parts += p.feed(d)
    parts += p.finish()
    return ("".join(x for k, x in parts if k == "reasoning"), "".join(x for k, x in parts if k == "content"))


def test_reasoning_complete():
    assert split_reasoning(THOUGHT) == ("the user wants x\nso y", "The answer is 4.")
    assert split_reasoning("no thinking here") == (None, "no thinking here")


@pytest.mark.parametrize("size", [1, 2, 3, 8, 1000])
def test_reasoning_streamed(size):
    r, c = stream_reasoning(THOUGHT, size)
    assert r.rstrip("\n") == "the user wants x\nso y" and c == "The answer is 4."


def test_reasoning_opened_by_prompt():
    # Qwen3.5 templates end the generation prompt with "<think>\n": output has only the close tag
    text = "hmm, 2+2\n</think>\n\n4"
    assert split_reasoning(text, in_think=True) == ("hmm, 2+2", "4")
    for size in (1, 2, 5):
        assert stream_reasoning(text, size, in_think=True) == ("hmm, 2+2\n", "4")


def test_reasoning_unclosed_and_partial_tags():
    assert split_reasoning("<think>still thinking") == ("still thinking", None)
    assert split_reasoning("a <thin b") == (None, "a <thin b")         # a held-back partial tag is released
    assert stream_reasoning("a <thin", 1) == ("", "a <thin")


def test_reasoning_then_tool_call():
    text = "<think>need weather</think>\n" + ONE_CALL
    r, c = split_reasoning(text)
    assert r == "need weather"
    content, calls = parse_tool_calls(c, WEATHER_TOOLS)
    assert content == "Let me check." and calls[0]["function"]["name"] == "get_weather"


# ---------------------------------------------------------------- stop strings
def run_stops(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        t, stopped = m.feed(d)
        out.append(t)
        if stopped:
            break
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped, out


def test_stop_across_token_boundaries():
    text, stopped, out = run_stops(["STOP"], ["hello S", "T", "O", "P and more"])
    assert (text, stopped) == ("hello ", True)
    assert out[0] == "hello "           # "S" held back while "STOP" may follow


def test_stop_false_start_is_released():
    text, stopped, out = run_stops(["STOP"], ["a ST", "x", "b"])
    assert (text, stopped) == ("a STxb", False)
    assert out[0] == "a " and out[1] == "STx"


def test_stop_earliest_of_several_and_overlaps():
    assert run_stops(["world", "lo w"], ["hel", "lo wor", "ld"])[:2] == ("hel", True)
    assert run_stops(["aab"], ["a", "a", "a", "b", "c"])[:2] == ("a", True)
    assert run_stops(["\n\n"], ["line\n", "\nnext"])[:2] == ("line", True)


@pytest.mark.parametrize("size", [1, 2, 3, 100])
def test_stop_any_chunking_matches_whole(size):
    text = "The quick brown fox <|end|> jumps"
    assert run_stops(["<|end|>"], pieces(text, size))[:2] == ("The quick brown fox ", True)
    assert run_stops(["zebra"], pieces(text, size))[:2] == (text, False)


def test_stop_unicode_and_empty():
    assert run_stops(["é!"], ["caf", "é", "!", "x"])[:2] == ("caf", True)
    assert run_stops([""], ["abc"])[:2] == ("abc", False)
    assert run_stops([], ["abc"])[:2] == ("abc", False)
