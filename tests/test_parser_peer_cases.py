"""The peers' own parser cases for the Qwen3-Coder XML tool-call format and the `<think>` reasoning
format, run through onegraph's parsers. Inputs and expected outputs are taken from the files named
at each case set (repository + path); the test code is onegraph's.

Every case runs non-streamed, and streamed in pieces of 1, 3 and 7 characters plus the peer's own
deltas where it gives them; all runs must give the expected result.

Where onegraph deliberately differs from a peer, the case is listed in DIFFERENCES with the reason,
and the test pins onegraph's behaviour.
"""
import json
import random

import pytest

from onegraph.server.parsers import ChatOutputParser, parse_chat_output, tool_schemas

from test_server_parsers import stream_parts


def tools_of(**fns):
    return tool_schemas([{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": props}}} for n, props in fns.items()])


def run(text, chunks, in_think=None, tools=None):
    """-> (reasoning, content, [(name, args dict)]) from feeding `chunks` (a size or a list)."""
    pieces = chunks if isinstance(chunks, list) else [text[i:i + chunks] for i in range(0, len(text), chunks)]
    assert "".join(pieces) == text
    parts, calls = stream_parts(ChatOutputParser(in_think, tools), pieces)
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert [c["index"] for c in calls] == list(range(len(calls)))
    reasoning = "".join(x for k, x in parts if k == "reasoning").rstrip("\n") or None
    content = "".join(x for k, x in parts if k == "content") or None
    return reasoning, content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def random_cuts(text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, len(text) // 4))) if len(text) > 1 else []
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


def check_all_chunkings(text, want, in_think=None, tools=None, deltas=None, norm=lambda r: r):
    """Non-streamed, then streamed at 1/3/7 chars, two seeded random cuttings and the peer's
    deltas: all equal `want`."""
    r, c, calls = parse_chat_output(text, in_think, tools)
    whole = (r, c, [(x["function"]["name"], json.loads(x["function"]["arguments"])) for x in calls])
    assert norm(whole) == want
    for chunks in [1, 3, 7, random_cuts(text, 0), random_cuts(text, 1)] + ([deltas] if deltas else []):
        assert run(text, chunks, in_think, tools) == whole, chunks


# ======================================================================== tool calls
# vllm-project/vllm tests/tool_parsers/test_qwen3_xml_coder_shared.py and
# tests/tool_parsers/test_qwen3coder_tool_parser.py (the shared extraction/streaming cases)
VLLM_TOOLS = tools_of(
    get_current_weather={"city": {"type": "string"}, "state": {"type": "string"},
                         "unit": {"type": "string", "enum": ["fahrenheit", "celsius"]}},
    calculate_area={"shape": {"type": "string"}, "dimensions": {"type": "object"}, "precision": {"type": "integer"}})

DALLAS = ("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n"
          "</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n</function>\n</tool_call>")
DALLAS_ARGS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
ORLANDO = DALLAS.replace("Dallas", "Orlando").replace("TX", "FL")
MISSING_CLOSE = ("Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\n"
                 "Dallas\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\nfahrenheit\n</parameter>\n"
                 "</function>\n</tool_call>")

VLLM_EXTRACT = {
    "no_tools": ("This is a test response without any tool calls",
                 "This is a test response without any tool calls", []),
    "single_tool": (DALLAS, None, [("get_current_weather", DALLAS_ARGS)]),
    "single_tool_with_content": ("Sure! Let me check the weather for you." + DALLAS,
                                 "Sure! Let me check the weather for you.", [("get_current_weather", DALLAS_ARGS)]),
    "single_tool_multiline_param": (
        "<tool_call>\n<function=calculate_area>\n<parameter=shape>\nrectangle\n</parameter>\n<parameter=dimensions>\n"
        "{\"width\": 10, \n \"height\": 20}\n</parameter>\n<parameter=precision>\n2\n</parameter>\n</function>\n"
        "</tool_call>", None,
        [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})]),
    "parallel_tools": (DALLAS + "\n" + ORLANDO, None, [
        ("get_current_weather", DALLAS_ARGS),
        ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "fahrenheit"})]),
    "tool_with_typed_params": (
        "Let me calculate that area for you.<tool_call>\n<function=calculate_area>\n<parameter=shape>\ncircle\n"
        "</parameter>\n<parameter=dimensions>\n{\"radius\": 15.5}\n</parameter>\n<parameter=precision>\n3\n"
        "</parameter>\n</function>\n</tool_call>", "Let me calculate that area for you.",
        [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})]),
    "missing_closing_parameter_tag": (MISSING_CLOSE, "Let me check the weather for you:",
                                      [("get_current_weather", DALLAS_ARGS)]),
    "incremental": ("I'll check the weather.<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n"
                    "</parameter>\n<parameter=state>\nTX\n</parameter>\n</function>\n</tool_call>",
                    "I'll check the weather.", [("get_current_weather", {"city": "Dallas", "state": "TX"})]),
    # malformed `<function=...` without '>' is not a call (vLLM drops it; onegraph keeps it as text)
    "none_tool_calls_filtered": (
        "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n<tool_call>\n<function=get_current_weather>"
        "\n<parameter=city>Dallas</parameter>\n<parameter=state>TX</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>",
        [("get_current_weather", {"city": "Dallas", "state": "TX"})]),
}
VLLM_DELTAS = {   # the peer's own chunkings (multi-parameter deltas from speculative decoding)
    "single_tool": ["<tool_call>", "\n<function=get_current_weather>", "\n",
                    "<parameter=city>\nDallas\n</parameter>\n<parameter=state>\nTX\n</parameter>"
                    "\n<parameter=unit>\nfahrenheit\n</parameter>", "\n</function>", "\n</tool_call>"],
}


@pytest.mark.parametrize("name", list(VLLM_EXTRACT))
def test_vllm_extract_and_stream(name):
    text, content, calls = VLLM_EXTRACT[name]
    check_all_chunkings(text, (None, content, calls), tools=VLLM_TOOLS, deltas=VLLM_DELTAS.get(name))


def test_vllm_malformed_no_gt_is_not_a_call():
    text = ("<tool_call>\n<function=get_current_weather\n<parameter=city>Dallas</parameter>\n</function>\n"
            "</tool_call>")
    check_all_chunkings(text, (None, text, []), tools=VLLM_TOOLS)


# vllm-project/vllm tests/tool_parsers/test_qwen3_xml_coder_shared.py and test_qwen3coder_tool_parser.py:
# type conversion, anyOf / nullable schemas, Python-literal and double-encoded objects
TYPED_TOOLS = tools_of(
    test_types={"int_param": {"type": "integer"}, "float_param": {"type": "float"}, "bool_param": {"type": "boolean"},
                "str_param": {"type": "string"}, "obj_param": {"type": "object"}},
    test_anyof={"anyof_int": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
                "anyof_str": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "anyof_array": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
                "anyof_obj": {"anyOf": [{"type": "object"}, {"type": "null"}]},
                "type_as_array": {"type": ["integer", "null"]},
                "multi_non_null": {"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}},
    search_web={"query": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "count": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
                "verbose": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
    set_code={"code": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    set_count={"count": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
    set_value={"optional": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
    update_record={"data": {"anyOf": [{"type": "object"}, {"type": "null"}]}},
    process={"name": {"type": "string"}, "data": {"type": "object"}},
    search={"query": {"type": "string"}},
    greet={"message": {"type": "string"}},
    pick={"items": {"type": "array"}})


def call(fn, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={fn}>\n{body}</function>\n</tool_call>"


def inline_call(fn, **params):     # the peers' `<parameter=p>value</parameter>` form, no newlines
    body = "".join(f"<parameter={k}>{v}</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={fn}>\n{body}</function>\n</tool_call>"


VLLM_TYPED = {
    "type_conversion": (call("test_types", int_param="42", float_param="3.14", bool_param="true",
                             str_param="hello world", obj_param='{"key": "value"}'),
                        {"int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
                         "obj_param": {"key": "value"}}),
    "complex_type_with_single_quote": (call("test_types", obj_param="{'key': 'value'}"),
                                       {"obj_param": {"key": "value"}}),
    "anyof_type_conversion": (call("test_anyof", anyof_int="5", anyof_str="hello", anyof_array='["a", "b", "c"]',
                                   anyof_obj='{"key": "value"}', type_as_array="42", multi_non_null="some text"),
                              {"anyof_int": 5, "anyof_str": "hello", "anyof_array": ["a", "b", "c"],
                               "anyof_obj": {"key": "value"}, "type_as_array": 42, "multi_non_null": "some text"}),
    "anyof_type_conversion_streaming": (call("search_web", query="vllm tool parser", count="10", verbose="true"),
                                        {"query": "vllm tool parser", "count": 10, "verbose": True}),
    "anyof_string_null_keeps_value_as_string": (inline_call("set_code", code="42"), {"code": "42"}),
    "anyof_integer_null_parses_as_int": (inline_call("set_count", count="42"), {"count": 42}),
    "python_none_value_for_nullable_int": (inline_call("set_count", count="None"), {"count": None}),
    "anyof_string_null_with_null_literal": (inline_call("set_value", optional="null"), {"optional": None}),
    "anyof_string_null_with_None_literal": (inline_call("set_value", optional="None"), {"optional": None}),
    "anyof_object_param_not_double_encoded": (inline_call("update_record", data='{"key": "value", "count": 42}'),
                                              {"data": {"key": "value", "count": 42}}),
    "double_encoded_object_param": (call("process", name="hello", data="\"{'key': 'value', 'n': 1}\"") + "\n",
                                    {"name": "hello", "data": {"key": "value", "n": 1}}),
    "string_null_value_preserved": (inline_call("search", query="null"), {"query": "null"}),
    "no_double_serialization_string_args": (inline_call("greet", message="hello world"), {"message": "hello world"}),
    "array_with_json_bool": (call("pick", items='["a", "b", 1, true]'), {"items": ["a", "b", 1, True]}),
}


@pytest.mark.parametrize("name", list(VLLM_TYPED))
def test_vllm_typed_parameters(name):
    text, args = VLLM_TYPED[name]
    fn = text.split("<function=")[1].split(">")[0]
    check_all_chunkings(text, (None, None, [(fn, args)]), tools=TYPED_TOOLS)


def test_vllm_no_double_serialization_raw_arguments():
    _, _, calls = parse_chat_output(inline_call("greet", message="hello world"), None, TYPED_TOOLS)
    assert '\\"hello world\\"' not in calls[0]["function"]["arguments"]


# vllm-project/vllm tests/tool_parsers/test_qwen3_xml_coder_shared.py: tag-like text inside values,
# nested literal calls, several calls in one delta, trailing text, phantom (unrendered template) calls
WRITE_TOOLS = tools_of(write_file={"path": {"type": "string"}, "content": {"type": "string"}},
                       get_weather={"city": {"type": "string"}}, log={"msg": {"type": "string"}})

XML_TAGS_IN_CONTENT = ('char_deltas = [\n    "<tool_call>\\n",\n    "<parameter=query>\\n",\n'
                       '    "\\n</parameter>\\n",\n    "</function>\\n",\n]\n')
PARAM_LIKE_LINES = ('TOOL_CALL_TEMPLATE = """\n</parameter>\n<parameter=new_string>\n#!/usr/bin/env python3\n'
                    '</parameter>\n"""\n')
REAL_PARAM_NAME_LITERAL = 'doc = """\n<parameter=path>\nliteral/value\n</parameter>\n"""\n'
FULL_NESTED_CALL = ('doc = """\n<tool_call>\n<function=write_file>\n<parameter=path>\nliteral/value.txt\n'
                    '</parameter>\n<parameter=content>\nhello\n</parameter>\n</function>\n</tool_call>\n"""\n')
OUT_OF_SCHEMA_NESTED = ('template = """\n<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n'
                        '</function>\n</tool_call>\n"""\n')


def write_file(path, content, tail="\n"):
    return (f"<tool_call>\n<function=write_file>\n<parameter=path>\n{path}\n</parameter>\n"
            f"<parameter=content>\n{content}</parameter>\n</function>\n</tool_call>{tail}")


FOO_BAR = "<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n</tool_call>"
TWO_WEATHER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
               "<tool_call>\n<function=get_weather>\n<parameter=city>\nLondon\n</parameter>\n</function>\n</tool_call>")
JINJA_PHANTOM = ("<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n</function>\n"
                 "</tool_call>")
INLINE_EMPTY_TEXT = "I'll show: <tool_call>example</tool_call>. Now real:"

VLLM_STRUCTURE = {
    "content_with_xml_structural_tags": (
        write_file("test.py", XML_TAGS_IN_CONTENT), None,
        [("write_file", {"path": "test.py", "content": XML_TAGS_IN_CONTENT.rstrip("\n")})],
        ["<tool_call>\n", "<function=write_file>\n", "<parameter=path>\ntest.py\n</parameter>\n",
         f"<parameter=content>\n{XML_TAGS_IN_CONTENT}</parameter>\n", "</function>\n", "</tool_call>\n"]),
    "content_with_param_like_lines": (
        write_file("test_template.py", PARAM_LIKE_LINES), None,
        [("write_file", {"path": "test_template.py", "content": PARAM_LIKE_LINES.rstrip("\n")})],
        ["<tool_call>\n", "<function=write_file>\n", "<parameter=path>\ntest_template.py\n</parameter>\n",
         '<parameter=content>\nTOOL_CALL_TEMPLATE = """\n', "</parameter>\n", "<parameter=new_string>\n",
         "#!/usr/bin/env python3\n", "</parameter>\n", '"""\n', "</parameter>\n", "</function>\n", "</tool_call>\n"]),
    "content_with_real_param_name_literal": (
        write_file("fixture.py", REAL_PARAM_NAME_LITERAL, ""), None,
        [("write_file", {"path": "fixture.py", "content": REAL_PARAM_NAME_LITERAL.rstrip("\n")})],
        ["<tool_call>\n", "<function=write_file>\n", "<parameter=path>\nfixture.py\n</parameter>\n",
         '<parameter=content>\ndoc = """\n', "<parameter=path>\n", "literal/value\n", "</parameter>\n", '"""\n',
         "</parameter>\n", "</function>\n", "</tool_call>"]),
    "content_with_full_nested_tool_call": (
        write_file("fixture.py", FULL_NESTED_CALL, ""), None,
        [("write_file", {"path": "fixture.py", "content": FULL_NESTED_CALL.rstrip("\n")})],
        ["<tool_call>\n", "<function=write_file>\n", "<parameter=path>\nfixture.py\n</parameter>\n",
         '<parameter=content>\ndoc = """\n', "<tool_call>\n", "<function=write_file>\n", "<parameter=path>\n",
         "literal/value.txt\n", "</parameter>\n", "<parameter=content>\n", "hello\n", "</parameter>\n",
         "</function>\n", "</tool_call>\n", '"""\n', "</parameter>\n", "</function>\n", "</tool_call>"]),
    "two_tools_second_with_out_of_schema_nested_literal": (
        FOO_BAR + "\n\n" + write_file("fixture.py", OUT_OF_SCHEMA_NESTED, ""), None,
        [("foo", {"bar": "baz"}), ("write_file", {"path": "fixture.py", "content": OUT_OF_SCHEMA_NESTED.rstrip("\n")})],
        ["<tool_call>\n<function=foo>\n", "<parameter=bar>baz</parameter>\n", "</function>\n</tool_call>", "\n\n",
         "<tool_call>\n<function=write_file>\n", "<parameter=path>\nfixture.py\n</parameter>\n",
         '<parameter=content>\ntemplate = """\n', "<tool_call>\n<function=foo>\n", "<parameter=bar>baz</parameter>\n",
         "</function>\n</tool_call>\n", '"""\n', "</parameter>\n", "</function>\n", "</tool_call>"]),
    "two_tool_calls_in_one_streaming_chunk": (
        TWO_WEATHER, None, [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})], [TWO_WEATHER]),
    "streaming_two_tool_calls_plus_trailing_text_one_delta": (
        TWO_WEATHER + "\nAll done!", "All done!",
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})], [TWO_WEATHER + "\nAll done!"]),
    "streaming_trailing_text_with_final_close_in_same_delta": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</tool_call>\n"
        "I hope this helps!", "I hope this helps!", [("get_weather", {"city": "Paris"})],
        ["<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>",
         "\n</tool_call>\nI hope this helps!"]),
    # the unrendered-template block is not a call; onegraph keeps its text as content (nothing lost)
    "jinja_template_phantom_tool_call_is_rejected": (
        JINJA_PHANTOM + "\n\n" + write_file("out.txt", "hello\n", ""), JINJA_PHANTOM,
        [("write_file", {"path": "out.txt", "content": "hello"})], None),
    "inline_empty_tool_call_preserves_content_before_real_call": (
        INLINE_EMPTY_TEXT + "\n<tool_call>\n<function=log>\n<parameter=msg>\nhi\n</parameter>\n</function>\n"
        "</tool_call>",
        INLINE_EMPTY_TEXT, [("log", {"msg": "hi"})], None),
}


@pytest.mark.parametrize("name", list(VLLM_STRUCTURE))
def test_vllm_structure(name):
    text, content, calls, deltas = VLLM_STRUCTURE[name]
    check_all_chunkings(text, (None, content, calls), tools=WRITE_TOOLS, deltas=deltas)


# sgl-project/sglang test/registered/function_call/test_qwen3_coder_detector/test_qwen3_coder_detector.py
SGL_TOOLS = tool_schemas([
    {"type": "function", "function": {"name": "get_current_weather", "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"}}, "required": ["location"]}}},
    {"type": "function", "function": {"name": "sql_interpreter", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "dry_run": {"type": "boolean"}}}}},
    {"type": "function", "function": {"name": "TodoWrite", "parameters": {"type": "object", "properties": {
        "todos": {"type": "array", "items": {"type": "object", "properties": {
            "content": {"type": "string"}, "status": {"type": "string"}}}}}}}},
    {"type": "function", "function": {"name": "get_current_time", "parameters": {"type": "object", "properties": {
        "cities": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}], "default": None}}}}},
    {"type": "function", "function": {"name": "process_optional_list", "parameters": {"type": "object", "properties": {
        "optional_items_to_process": {"anyOf": [{"anyOf": [{"type": "null"}, {"anyOf": [
            {"type": "array", "items": {}}, {"type": "null"}]}]}, {"type": "null"}], "default": None}}}}},
])
NY_SQL = ("<tool_call>\n<function=get_current_weather>\n<parameter=location>New York</parameter>\n</function>\n"
          "</tool_call>\n<tool_call>\n<function=sql_interpreter>\n<parameter=query>SELECT * FROM users</parameter>\n"
          "<parameter=dry_run>True</parameter>\n</function>\n</tool_call>")
SGL_CASES = {
    "plain_text_only": ("This is plain text without any tool calls.", "This is plain text without any tool calls.",
                        [], None),
    "single_tool_call_with_text_prefix": (
        "Let me check the weather for you.\n\n<tool_call>\n<function=get_current_weather>\n"
        "<parameter=location>New York</parameter>\n</function>\n</tool_call>", "Let me check the weather for you.",
        [("get_current_weather", {"location": "New York"})], None),
    "multiple_tool_calls": (NY_SQL, None, [("get_current_weather", {"location": "New York"}),
                                           ("sql_interpreter", {"query": "SELECT * FROM users", "dry_run": True})],
                            None),
    "streaming_single_tool_call": (
        "<tool_call><function=get_current_weather><parameter=location>Boston</parameter>"
        "<parameter=unit>celsius</parameter></function></tool_call>", None,
        [("get_current_weather", {"location": "Boston", "unit": "celsius"})],
        ["<tool_call>", "<function=get_current_weather>", "<parameter=location>", "Boston", "</parameter>",
         "<parameter=unit>celsius</parameter>", "</function>", "</tool_call>"]),
    "streaming_with_text_and_tool": (
        "Let me help you.\n\n<tool_call><function=get_current_weather><parameter=location>Paris</parameter>"
        "</function></tool_call>", "Let me help you.", [("get_current_weather", {"location": "Paris"})],
        ["Let me ", "help you.\n\n", "<tool_call>", "<function=get_current_weather>",
         "<parameter=location>Paris</parameter>", "</function>", "</tool_call>"]),
    "integer_parameter_conversion": (
        "<tool_call>\n<function=get_current_weather>\n<parameter=location>Tokyo</parameter>\n"
        "<parameter=days>5</parameter>\n</function>\n</tool_call>", None,
        [("get_current_weather", {"location": "Tokyo", "days": 5})], None),
    "boolean_parameter_conversion": (
        "<tool_call>\n<function=sql_interpreter>\n<parameter=query>SELECT 1</parameter>\n"
        "<parameter=dry_run>True</parameter>\n</function>\n</tool_call>", None,
        [("sql_interpreter", {"query": "SELECT 1", "dry_run": True})], None),
    "complex_array_parameter": (
        "<tool_call>\n<function=TodoWrite>\n<parameter=todos>\n[\n  {\"content\": \"Buy groceries\", \"status\": "
        "\"pending\"},\n  {\"content\": \"Finish report\", \"status\": \"completed\"}\n]\n</parameter>\n</function>\n"
        "</tool_call>", None, [("TodoWrite", {"todos": [{"content": "Buy groceries", "status": "pending"},
                                                       {"content": "Finish report", "status": "completed"}]})], None),
    "anyof_array_parameter_conversion": (
        "<tool_call>\n<function=get_current_time>\n<parameter=cities>\n[\"NYC\"]\n</parameter>\n</function>\n"
        "</tool_call>", None, [("get_current_time", {"cities": ["NYC"]})], None),
    "streaming_anyof_array_parameter_conversion": (
        '<tool_call><function=get_current_time><parameter=cities>["NYC"]</parameter></function></tool_call>', None,
        [("get_current_time", {"cities": ["NYC"]})],
        ["<tool_call>", "<function=get_current_time>", "<parameter=cities>", '["NYC"]', "</parameter>",
         "</function>", "</tool_call>"]),
    "anyof_array_parameter_conversion_null": (
        "<tool_call>\n<function=get_current_time>\n<parameter=cities>\nnull\n</parameter>\n</function>\n</tool_call>",
        None, [("get_current_time", {"cities": None})], None),
    "empty_parameter_value": (
        "<tool_call>\n<function=get_current_weather>\n<parameter=location></parameter>\n</function>\n</tool_call>",
        None, [("get_current_weather", {"location": ""})], None),
    "parameter_with_special_characters": (
        "<tool_call>\n<function=sql_interpreter>\n<parameter=query>SELECT * FROM users WHERE name = 'John \"Doe\"'"
        "</parameter>\n</function>\n</tool_call>", None,
        [("sql_interpreter", {"query": "SELECT * FROM users WHERE name = 'John \"Doe\"'"})], None),
    "nested_anyof_array_with_multiple_types": (
        "<tool_call>\n<function=process_optional_list>\n<parameter=optional_items_to_process>\n"
        "[true, null, {\"enabled\": false}]\n</parameter>\n</function>\n</tool_call>", None,
        [("process_optional_list", {"optional_items_to_process": [True, None, {"enabled": False}]})], None),
}


@pytest.mark.parametrize("name", list(SGL_CASES))
def test_sglang_detector(name):
    text, content, calls, deltas = SGL_CASES[name]
    check_all_chunkings(text, (None, content, calls), tools=SGL_TOOLS, deltas=deltas)


def test_sglang_incomplete_tool_call_does_not_crash():
    # the peer only asks for no crash; onegraph closes the cut call with what it has (see DIFFERENCES)
    text = "<tool_call>\n<function=get_current_weather>\n<parameter=location>London"
    check_all_chunkings(text, (None, None, [("get_current_weather", {"location": "London"})]), tools=SGL_TOOLS)


# sgl-project/sglang test/registered/function_call/test_qwen3_coder_detector/test_cases.py (+ test_fixtures.py).
# The peer writes these without the <tool_call> wrapper; here they run wrapped (the bare form is a
# documented difference below). Expected text is compared without surrounding whitespace, which
# onegraph drops around tool calls.
def wrap_functions(text):
    return text.replace("<function=", "<tool_call>\n<function=").replace("</function>", "</function>\n</tool_call>")


SGL_BARE = {
    "single_tool_call": (
        "<function=get_current_weather>\n<parameter=location>Boston</parameter>\n<parameter=unit>celsius</parameter>\n"
        "<parameter=days>3</parameter>\n</function>", "",
        [("get_current_weather", {"location": "Boston", "unit": "celsius", "days": 3})]),
    "single_tool_call_with_text": (
        "Text prefix + tool call test\n\n<function=get_current_weather>\n<parameter=location>Boston</parameter>\n"
        "<parameter=unit>celsius</parameter>\n<parameter=days>3</parameter>\n</function>",
        "Text prefix + tool call test\n    \n",
        [("get_current_weather", {"location": "Boston", "unit": "celsius", "days": 3})]),
    "double_tool_call": (
        "Text prefix + double tool call test\n\n<function=get_current_weather>\n<parameter=location>New York"
        "</parameter>\n</function>\n<function=sql_interpreter>\n<parameter=query>SELECT * FROM users</parameter>\n"
        "<parameter=dry_run>True</parameter>\n</function>\n", "Text prefix + double tool call test\n\n",
        [("get_current_weather", {"location": "New York"}),
         ("sql_interpreter", {"query": "SELECT * FROM users", "dry_run": True})]),
    "random_fragmentation": (
        "Text prefix + random fragmentation stress test\n\n<function=get_current_weather>\n"
        "<parameter=location>San Francisco</parameter>\n</function>",
        "Text prefix + random fragmentation stress test\n\n", [("get_current_weather", {"location": "San Francisco"})]),
    "implicit_parameter_close": (
        "Text prefix + implicit parameter close test\n\n<function=get_current_weather>\n<parameter=location>Paris\n"
        "<parameter=unit>celsius\n<parameter=days>3\n</function>", "Text prefix + implicit parameter close test\n\n",
        [("get_current_weather", {"location": "Paris", "unit": "celsius", "days": 3})]),
    "complex_schema": (
        "Text prefix + complex schema tool call test\n\n<function=TodoWrite>\n<parameter=todos>\n[\n"
        " {\"content\": \"Buy a new car\", \"status\": 'pending'},\n {\"content\": \"Buy a new house\", "
        "\"status\": \"completed\"}\n]\n</parameter>\n</function>\n\n",
        "Text prefix + complex schema tool call test\n\n",
        [("TodoWrite", {"todos": [{"content": "Buy a new car", "status": "pending"},
                                  {"content": "Buy a new house", "status": "completed"}]})]),
}


@pytest.mark.parametrize("name", list(SGL_BARE))
def test_sglang_cases_wrapped(name):
    text, content, calls = SGL_BARE[name]
    strip = lambda r: (r[0], (r[1] or "").strip() or None, r[2])   # noqa: E731
    check_all_chunkings(wrap_functions(text), (None, content.strip() or None, calls), tools=SGL_TOOLS, norm=strip)


# ======================================================================== reasoning
# vllm-project/vllm tests/reasoning/test_qwen3_reasoning_parser.py. The peer's qwen3 parser assumes
# the prompt opened <think> (Qwen3.5/3.6 templates do): in_think=True here. The peer keeps the
# newlines next to the tags in the reasoning; onegraph drops those the template writes around
# them, so reasoning is compared without newlines at its ends.
TOOL_CALL_BODY = ("<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n"
                  "</tool_call>")
BASH_TOOLS = tools_of(bash={"command": {"type": "string"}})
QWEN3_REASONING = {
    "without_start_token": ("This is a reasoning section</think>This is the rest", "This is a reasoning section",
                            "This is the rest"),
    "without_start_token_complete_reasoning": ("This is a reasoning section</think>", "This is a reasoning section",
                                               None),
    "with_think": ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section",
                   "This is the rest"),
    "without_think": ("This is the rest", "This is the rest", None),
    "complete_reasoning": ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    "multiline_reasoning": ("<think>This is a reasoning\nsection</think>This is the rest\nThat",
                            "This is a reasoning\nsection", "This is the rest\nThat"),
    "only_open_tag": ("<think>This is a reasoning section", "This is a reasoning section", None),
    "truncated_no_start_token": ("This is a reasoning section", "This is a reasoning section", None),
}
QWEN3_DELTAS = {   # the peer's multi-token deltas
    "start_token_grouped_with_text": (["<think>This is a reasoning section", "</think>", "This is the rest"],
                                      "This is a reasoning section", "This is the rest"),
    "end_token_grouped_with_content": (["reasoning section", "</think>This is the rest"], "reasoning section",
                                       "This is the rest"),
    "start_and_end_in_one_delta_no_content": (["<think>reasoning</think>"], "reasoning", None),
    "no_start_end_grouped_with_content": (["reasoning section", "</think>content"], "reasoning section", "content"),
}


@pytest.mark.parametrize("name", list(QWEN3_REASONING))
@pytest.mark.parametrize("tools", [None, BASH_TOOLS], ids=["no_tools", "tools"])
def test_vllm_qwen3_reasoning(name, tools):
    text, reasoning, content = QWEN3_REASONING[name]
    check_all_chunkings(text, (reasoning, content, []), in_think=True, tools=tools)


@pytest.mark.parametrize("name", list(QWEN3_DELTAS))
def test_vllm_qwen3_reasoning_multi_token_deltas(name):
    deltas, reasoning, content = QWEN3_DELTAS[name]
    check_all_chunkings("".join(deltas), (reasoning, content, []), in_think=True, deltas=deltas)


@pytest.mark.parametrize("text", ["I need to read the file.\n\n" + TOOL_CALL_BODY,
                                  "<think>I need to read the file.\n\n" + TOOL_CALL_BODY])
def test_vllm_qwen3_tool_call_without_think_end(text):
    # the peer moves the block to content for its tool parser; onegraph parses it into a call directly
    check_all_chunkings(text, ("I need to read the file.", None, [("bash", {"command": "cat /etc/hosts"})]),
                        in_think=True, tools=BASH_TOOLS,
                        deltas=["I need to read the file.\n\n", TOOL_CALL_BODY[:27], TOOL_CALL_BODY[27:]]
                        if not text.startswith("<think>") else None)


@pytest.mark.parametrize("text", ["This is plain content", "Some output without think tokens",
                                  "I need to read the file.\n\n" + TOOL_CALL_BODY])
def test_vllm_qwen3_thinking_disabled(text):
    # enable_thinking=False: the prompt did not open <think> (in_think=False); no tools -> all content
    check_all_chunkings(text, (None, text, []), in_think=False, tools=None)


def test_vllm_qwen3_thinking_disabled_with_tools_parses_the_call():
    check_all_chunkings("I need to read the file.\n\n" + TOOL_CALL_BODY,
                        (None, "I need to read the file.", [("bash", {"command": "cat /etc/hosts"})]),
                        in_think=False, tools=BASH_TOOLS)


# vllm-project/vllm tests/reasoning/test_qwen3_tool_call_recovery.py: a call emitted inside <think>
FINISH_BLOCK = "<tool_call>\n<function=Finish>\n<parameter=answer>\n204\n</parameter>\n</function>\n</tool_call>"
FINISH_TOOLS = tools_of(Finish={"answer": {"type": "string"}})
RECOVERY = {
    "embedded_tool_call_is_promoted": (
        "<think>The verification confirms my solution:\n- s = 2.5 km/h\n- t = 24 minutes\n"
        "- Total time at speed 3 km/h = 204 minutes\n\n" + FINISH_BLOCK + "\n</think>",
        "The verification confirms my solution:\n- s = 2.5 km/h\n- t = 24 minutes\n"
        "- Total time at speed 3 km/h = 204 minutes", None),
    "existing_content_text_is_preserved": ("<think>verify result\n" + FINISH_BLOCK + "</think>Here is the answer.",
                                           "verify result", "Here is the answer."),
    "trailing_text_preserved": ("<think>verify result\n" + FINISH_BLOCK + "</think>assistant trailing text",
                                "verify result", "assistant trailing text"),
    "truncated_reasoning_still_recovers": ("verify result\n" + FINISH_BLOCK, "verify result", None),
}


@pytest.mark.parametrize("name", list(RECOVERY))
@pytest.mark.parametrize("in_think", [True, False])
def test_vllm_qwen3_tool_call_recovery(name, in_think):
    text, reasoning, content = RECOVERY[name]
    want = (reasoning, content, [("Finish", {"answer": "204"})])
    if not in_think and not text.startswith("<think>"):
        want = (None, reasoning, want[2])      # no <think> anywhere: the text before the call is content
    check_all_chunkings(text, want, in_think=in_think, tools=FINISH_TOOLS)


def test_vllm_qwen3_recovery_normal_reasoning_unchanged():
    check_all_chunkings("<think>Let me think about this carefully.\nThe answer is 42.</think>The answer is 42.",
                        ("Let me think about this carefully.\nThe answer is 42.", "The answer is 42.", []),
                        in_think=True, tools=FINISH_TOOLS)
    check_all_chunkings("<think>some reasoning</think>plain response text",
                        ("some reasoning", "plain response text", []), in_think=False, tools=FINISH_TOOLS)


# ======================================================================== documented differences
DIFFERENCES = {
    # vLLM test_extract_tool_calls_fallback_no_tags and SGLang test_cases.py accept a bare
    # `<function=…>` without `<tool_call>`. onegraph does not: Qwen3.5/3.6 emit `<tool_call>` as one
    # special token and their template always writes it, so a bare `<function=…>` is text that
    # talks about the format (docs, code); running it as a call would act on prose.
    "bare_function_without_tool_call": (
        "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>",
        (None, "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n</function>", [])),
    # vLLM (tools=None) keeps an undeclared function's "204" a string; onegraph, like SGLang, reads a
    # value with no schema as JSON when it is JSON (numbers, booleans, objects stay typed).
    "untyped_value_reads_json": (FINISH_BLOCK, (None, None, [("Finish", {"answer": 204})])),
    # The older JSON-inside-<tool_call> form (vLLM's and SGLang's hermes / qwen25 parsers) is not
    # parsed: Qwen3.5/3.6 templates teach only the XML form, so JSON there is text about JSON.
    "json_in_tool_call_is_text": ('<tool_call>\n{"name": "Finish", "arguments": {"answer": "204"}}\n</tool_call>',
                                  (None, '<tool_call>\n{"name": "Finish", "arguments": {"answer": "204"}}\n'
                                         '</tool_call>', [])),
    # A cut call: the peers only ask for no crash. onegraph already streamed the name and arguments,
    # so the call stands with the arguments seen, closed as valid JSON; the finish reason is "length".
    "cut_call_keeps_its_arguments": ("<tool_call>\n<function=Finish>\n<parameter=answer>\n20",
                                     (None, None, [("Finish", {"answer": 20})])),
}


@pytest.mark.parametrize("name", list(DIFFERENCES))
def test_documented_difference(name):
    text, want = DIFFERENCES[name]
    check_all_chunkings(text, want, tools={})
