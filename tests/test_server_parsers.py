"""Server text machinery on scripted outputs: tool-call and reasoning parsers (complete, streamed in
pieces of every size, malformed, cut, calls inside <think>), the real Qwen3.5 chat template (server
render vs transformers', parsed turn re-rendered) and the stop-string matcher across token
boundaries. The peers' own parser cases are in test_parser_peer_cases.py."""
import json
from pathlib import Path

import pytest

from onegraph.server.parsers import (ChatOutputParser, ReasoningParser, ToolCallParser, convert_value,
                                     merge_tool_delta, parse_chat_output, parse_tool_calls, schema_types,
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
    """Streamed in pieces -> (content or None, whole calls with their index). Checks the delta
    protocol: a call's first delta carries id, type and name; later ones only argument pieces."""
    p = ToolCallParser(tools)
    parts = []
    for d in pieces(text, size):
        parts += p.feed(d)
    parts += p.finish()
    content = "".join(x for k, x in parts if k == "content")
    calls = []
    for k, x in parts:
        if k == "tool_call":
            first = x["index"] == len(calls)
            assert set(x) == ({"index", "id", "type", "function"} if first else {"index", "function"})
            merge_tool_delta(calls, x)
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
    assert want[0]["function"]["arguments"] == json.dumps({"city": "Paris", "days": 3})   # json.dumps spacing


def test_no_tool_call_passes_text_through_exactly():
    text = "plain answer with <tool and <tool_cal but no call  \n\n"
    for size in (1, 4, 100):
        assert stream_tools(text, size) == (text, [])


@pytest.mark.parametrize("text", [
    "x <tool_call>no function here</tool_call> y",                                       # no <function=>
    "<tool_call><function=>\n</function></tool_call>",                                   # empty name
    "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>",                      # not a name
    "a <tool_call>\n<function=f>\nhello <parameter=x>1</parameter></function></tool_call>",  # text before params
    "cut <tool_call>\n<function=get_weather>\n",                                         # cut before a parameter
])
def test_block_that_is_not_a_call_stays_content(text):
    for size in (1, 3, 1000):
        assert stream_tools(text, size) == (text, [])


@pytest.mark.parametrize("text, args", [
    # cut by max_tokens inside a value: the name and arguments were already streamed, so the call
    # stands with what it has, closed as valid JSON (the server reports finish_reason "length")
    ("before <tool_call>\n<function=get_weather>\n<parameter=city>\nPa", {"city": "Pa"}),
    ("before <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n",
     {"city": "Paris", "days": ""}),
    # no </parameter> before </function>: </function></tool_call> closes the value
    ("before <tool_call>\n<function=get_weather>\n<parameter=days>2</function>\n</tool_call>", {"days": 2}),
    # a </parameter> that no structure follows is text of the value
    ("before <tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>junk\n</function>\n</tool_call>",
     {"city": "A\n</parameter>junk"}),
])
def test_cut_or_loose_calls(text, args):
    for size in (1, 3, 1000):
        content, calls = stream_tools(text, size)
        assert content == "before"
        got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]
        assert got == [("get_weather", args)]


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
    assert convert_value("null", {"type": "string"}) == "null"          # a plain string keeps "null"
    assert convert_value("null", {"type": ["string", "null"]}) is None  # a nullable one reads it as null
    # anyOf / oneOf as pydantic writes Optional[T]: the first declared type that fits wins
    assert convert_value("42", {"anyOf": [{"type": "string"}, {"type": "null"}]}) == "42"
    assert convert_value("42", {"oneOf": [{"type": "integer"}, {"type": "string"}]}) == 42
    assert convert_value("abc", {"oneOf": [{"type": "integer"}, {"type": "string"}]}) == "abc"
    assert convert_value("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) is None
    assert convert_value("1_000", {"type": "integer"}) == "1_000"       # Python-only spellings are not numbers
    assert convert_value("nan", {"type": "number"}) == "nan"
    assert convert_value("[1e999]", {"type": "array"}) == "[1e999]"      # not representable in JSON
    assert convert_value("{1, 2}", {"type": "array"}) == "{1, 2}"        # a Python set is not a JSON array
    assert convert_value("{'a': (1, None)}", {"type": "object"}) == {"a": (1, None)}
    assert schema_types({"anyOf": [{"anyOf": [{"type": "null"}, {"type": "array"}]}, {"enum": ["a", 1]}]}) == \
        (["array", "string", "integer"], True)


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


# ---------------------------------------------------------------- streaming arguments, calls in <think>
WRITE_TOOLS = tool_schemas([{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"},
                                     "mode": {"type": "integer"}}}}}])
BODY = ('line one\n  "quoted" \\ back\n</parameter> not a close\n'
        '<tool_call>\n<function=x>\n</function>\n</tool_call>\nend')
LONG = ("I'll write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
        f"<parameter=content>\n{BODY}\n</parameter>\n<parameter=mode>\n644\n</parameter>\n</function>\n</tool_call>")


def test_arguments_stream_before_the_call_closes():
    """Name first, then string arguments while they generate; the pieces concatenate to exactly
    the non-streamed arguments."""
    p = ToolCallParser(WRITE_TOOLS)
    seen = []                                  # (chars fed, delta)
    for n, ch in enumerate(LONG, 1):
        seen += [(n, x) for k, x in p.feed(ch) if k == "tool_call"]
    seen += [(len(LONG), x) for k, x in p.finish() if k == "tool_call"]
    head = LONG.index("<parameter=path>") + len("<parameter=path>")
    assert seen[0][1]["function"] == {"name": "write_file", "arguments": ""} and seen[0][0] == head
    args = "".join(x["function"]["arguments"] for _, x in seen)
    _, (want,) = parse_tool_calls(LONG, WRITE_TOOLS)
    assert args == want["function"]["arguments"]
    assert json.loads(args) == {"path": "/tmp/a.py", "content": BODY, "mode": 644}
    # most of the content went out before its </parameter> arrived (held: only undecided tags)
    end_of_content = LONG.index("\n</parameter>\n<parameter=mode>")
    early = "".join(x["function"]["arguments"] for n, x in seen if n <= end_of_content)
    assert early.startswith('{"path": "/tmp/a.py", "content": "line one\\n  \\"quoted\\" \\\\ back\\n')
    assert len(early) > len(json.dumps(BODY)) // 2


@pytest.mark.parametrize("size", range(1, 14))
def test_streamed_arguments_equal_whole_at_every_chunk_size(size):
    content, calls = stream_tools(LONG, size, WRITE_TOOLS)
    want_content, want = parse_tool_calls(LONG, WRITE_TOOLS)
    assert content == want_content == "I'll write it."
    assert [c["function"] for c in calls] == [c["function"] for c in want]


def stream_parts(p, chunks) -> tuple[list, list[dict]]:
    """Feed a parser the chunks one by one, then the final empty feed -> (its (kind, piece) parts, the tool
    calls its deltas merge into, stream indices kept)."""
    parts = []
    for d in chunks:
        parts += p.feed(d)
    parts += p.feed("", final=True)
    calls = []
    for k, x in parts:
        if k == "tool_call":
            merge_tool_delta(calls, x)
    return parts, calls


def run_chat(text, size, in_think, tools):
    p = ChatOutputParser(in_think, tools)
    parts, calls = stream_parts(p, pieces(text, size))
    return ("".join(x for k, x in parts if k == "reasoning").rstrip("\n") or None,
            "".join(x for k, x in parts if k == "content") or None,
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], p.n_calls)


IN_THINK = ("I should look it up.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "</function>\n</tool_call>\nThen answer.\n</think>\n\nLooking.\n" + TWO_CALLS.split("\n\n", 1)[1])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
def test_tool_call_inside_think_is_a_call(size):
    r, c, calls, n = run_chat(IN_THINK, size, True, WEATHER_TOOLS)
    assert r == "I should look it up.\nThen answer."
    assert c == "Looking."
    assert calls == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Paris", "days": 3}),
                     ("get_weather", {"city": "New York, NY", "metric": True, "extra": {"a": [1, 2]}})]
    assert n == 3
    whole = parse_chat_output(IN_THINK, True, WEATHER_TOOLS)
    assert (whole[0], whole[1], [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in whole[2]]) \
        == (r, c, calls)


def test_tool_call_inside_think_without_tools_stays_reasoning():
    r, c, calls, n = run_chat(IN_THINK, 3, True, None)
    assert r.startswith("I should look it up.\n<tool_call>\n<function=get_weather>") and calls == [] and n == 0


def test_not_a_call_inside_think_stays_reasoning():
    text = "compare <tool_call> with <tool_call>\n<function=get_weather>\n</think>\nok"
    for size in (1, 4, 100):
        assert run_chat(text, size, True, WEATHER_TOOLS) == (
            "compare <tool_call> with <tool_call>\n<function=get_weather>", "ok", [], 0)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_repeated_think_after_prompt_opened_it(size):
    # the prompt ends with "<think>\n" and the model writes <think> again
    text = "<think>I need to think about this.</think>The answer is 42."
    assert run_chat(text, size, True, None) == ("I need to think about this.", "The answer is 42.", [], 0)
    assert run_chat("\n" + text, size, True, None)[:2] == ("I need to think about this.", "The answer is 42.")
    assert run_chat("<thinking is fun</think>ok", size, True, None)[:2] == ("<thinking is fun", "ok")
    assert run_chat("<thi", size, True, None)[:2] == ("<thi", None)


# ---------------------------------------------------------------- the real Qwen3.5 chat template
# tests/data/qwen3_5_chat_template.jinja: Qwen/Qwen3.5-4B's template (source in tests/data/README.md)
QWEN_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_5_chat_template.jinja").read_text()
QWEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "opts": {"type": "object"}}, "required": ["city"]}}}]


def qwen_call(cid, city, **more):
    return {"id": cid, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city, **more})}}


HISTORY = [   # OpenAI wire form: tool-call arguments are JSON text
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris and Lyon?"},
    {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities, two calls.",
     "tool_calls": [qwen_call("call_1", "Paris"), qwen_call("call_2", "Lyon", days=2)]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
    {"role": "assistant", "content": "Paris: sunny. Lyon: rain.", "reasoning_content": "Summarize."},
    {"role": "user", "content": "And tomorrow in Paris, by the hour?"},
]
# what the model writes after the generation prompt "<|im_start|>assistant\n<think>\n"
EMITTED = ("The user wants tomorrow, hourly.\n</think>\n\nLet me check.\n\n<tool_call>\n<function=get_weather>\n"
           "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n1\n</parameter>\n<parameter=opts>\n"
           '{"units": "metric", "hours": [9, 12]}\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
           "<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n</function>\n</tool_call>")


def qwen_codec():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from onegraph.runtime.codec import TextCodec
    return TextCodec(Tokenizer(WordLevel({"x": 0}, unk_token="x")), QWEN_TEMPLATE, {"bos_token": "", "eos_token": ""})


def hf_render(messages, add_generation_prompt):
    """Oracle: transformers' own chat-template rendering (arguments as mappings, its convention)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"x": 0}, unk_token="x")))
    msgs = json.loads(json.dumps(messages))
    for m in msgs:
        for c in m.get("tool_calls") or []:
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return tok.apply_chat_template(msgs, tools=QWEN_TOOLS, chat_template=QWEN_TEMPLATE, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)


def test_qwen_template_renders_like_transformers():
    codec = qwen_codec()
    prompt = codec.render_chat(HISTORY, QWEN_TOOLS, add_generation_prompt=True)
    assert prompt == hf_render(HISTORY, True)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    assert "<tool_call>\n<function=get_weather>\n<parameter=city>\nLyon\n</parameter>\n<parameter=days>\n2\n" in prompt


@pytest.mark.parametrize("size", [1, 5, 10_000])
def test_parsed_turn_rerenders_to_what_the_model_emitted(size):
    codec = qwen_codec()
    prompt = codec.render_chat(HISTORY, QWEN_TOOLS, add_generation_prompt=True)
    p = ChatOutputParser(prompt.rstrip().endswith("<think>"), tool_schemas(QWEN_TOOLS))
    parts, calls = stream_parts(p, pieces(EMITTED, size))
    turn = {"role": "assistant", "content": "".join(x for k, x in parts if k == "content"),
            "reasoning_content": "".join(x for k, x in parts if k == "reasoning").rstrip("\n"),
            "tool_calls": [{k: v for k, v in c.items() if k != "index"} for c in calls]}
    assert turn["content"] == "Let me check." and turn["reasoning_content"] == "The user wants tomorrow, hourly."
    history = HISTORY + [turn]
    assert codec.render_chat(history, QWEN_TOOLS, add_generation_prompt=False) == prompt + EMITTED + "<|im_end|>\n"
    # and the conversation goes on: tool results after the parsed turn render as transformers does
    history += [{"role": "tool", "tool_call_id": calls[0]["id"], "content": "9h: 18C"},
                {"role": "tool", "tool_call_id": calls[1]["id"], "content": "rain"}]
    assert codec.render_chat(history, QWEN_TOOLS, add_generation_prompt=True) == hf_render(history, True)


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
