"""Output parsers for Qwen3.5/3.6 text: reasoning (`<think>…</think>`) and XML tool calls.

Tool calls as Qwen3.5/3.6 (and Qwen3-Coder) emit them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Both parsers are incremental state machines: `feed(delta) -> [(kind, payload)]` and `finish()`.
The non-streaming result is the same machine fed the whole text at once, so a streamed response
and a non-streamed one never disagree. Text that might be the start of a tag is held back until
it is decided. Anything malformed (an unclosed block, a block without `<function=…>`, junk between
parameters) is passed through unchanged as plain content — a parser never loses text.

Kinds: "reasoning" (str), "content" (str), "tool_call" (dict in OpenAI `tool_calls` form).
"""
from __future__ import annotations

import json
import re
import uuid

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_FUNC = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


# ---------------------------------------------------------------- reasoning
class ReasoningParser:
    """Splits `<think>…</think>` into reasoning. `in_think=True` when the prompt already opened
    the block (Qwen3.5 templates end the generation prompt with `<think>\\n`)."""

    def __init__(self, in_think: bool = False):
        self.in_think = in_think
        self.held = ""
        self.strip_nl = in_think          # drop newlines right after a tag
        self.seen_think = in_think

    def feed(self, delta: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        buf = self.held + delta
        self.held = ""
        while buf:
            tag = THINK_CLOSE if self.in_think else THINK_OPEN
            i = buf.find(tag)
            if i >= 0:
                self._emit(out, buf[:i])
                buf = buf[i + len(tag):]
                self.in_think = not self.in_think
                self.seen_think = True
                self.strip_nl = True
                continue
            keep = _partial_suffix(buf, tag)
            self._emit(out, buf[:len(buf) - keep])
            self.held = buf[len(buf) - keep:]
            break
        return out

    def _emit(self, out, text: str):
        if self.strip_nl:
            text = text.lstrip("\n")
            if not text:
                return
            self.strip_nl = False
        if text:
            kind = "reasoning" if self.in_think else "content"
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._emit(out, self.held)
        self.held = ""
        return out


def split_reasoning(text: str, in_think: bool = False) -> tuple[str | None, str | None]:
    """Whole text -> (reasoning_content or None, content or None)."""
    p = ReasoningParser(in_think)
    parts = p.feed(text) + p.finish()
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    return (reasoning.rstrip("\n") or None) if p.seen_think else None, content or None


# ---------------------------------------------------------------- tool calls
def _types(schema) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    if "enum" in schema:
        return ["string"] if all(isinstance(v, str) for v in schema["enum"]) else []
    return []


def convert_value(raw: str, schema) -> object:
    """A parameter's text -> a JSON value, guided by the tool's JSON schema when there is one."""
    types = _types(schema)
    if "string" in types:
        return raw
    if raw.strip().lower() in ("null", "none") and ("null" in types or not types):
        return None
    for t in types:
        try:
            if t == "integer":
                return int(raw.strip())
            if t == "number":
                v = float(raw.strip())
                return int(v) if v.is_integer() and "." not in raw and "e" not in raw.lower() else v
            if t == "boolean":
                low = raw.strip().lower()
                if low in ("true", "false"):
                    return low == "true"
            if t in ("object", "array"):
                return json.loads(raw)
        except ValueError:
            continue
    if types:
        return raw
    try:                                  # no schema: numbers, booleans, objects stay typed
        return json.loads(raw)
    except ValueError:
        return raw


def _strip_one_nl(s: str) -> str:
    if s.startswith("\n"):
        s = s[1:]
    if s.endswith("\n"):
        s = s[:-1]
    return s


def parse_tool_block(block: str, tools: dict | None = None) -> list[dict] | None:
    """The text between `<tool_call>` and `</tool_call>` -> [{"name", "arguments": dict}], or None
    when it is not well formed."""
    calls, pos = [], 0
    for m in _FUNC.finditer(block):
        if block[pos:m.start()].strip():
            return None
        pos = m.end()
        name, body = m.group(1).strip(), m.group(2)
        if not name:
            return None
        props = ((tools or {}).get(name) or {}).get("properties") or {}
        args, ppos = {}, 0
        for pm in _PARAM.finditer(body):
            if body[ppos:pm.start()].strip():
                return None
            ppos = pm.end()
            pname = pm.group(1).strip()
            args[pname] = convert_value(_strip_one_nl(pm.group(2)), props.get(pname))
        if body[ppos:].strip():
            return None
        calls.append({"name": name, "arguments": args})
    if not calls or block[pos:].strip():
        return None
    return calls


def tool_schemas(tools: list[dict] | None) -> dict:
    """OpenAI `tools` -> {function name: parameters schema}."""
    out = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    return out


class ToolCallParser:
    """Content text in -> content deltas and complete tool calls out. A tool call is emitted in
    one piece (name and full arguments) once its `</tool_call>` arrives. Whitespace around tool
    calls is dropped; with no tool calls the content passes through byte for byte."""

    def __init__(self, tools: dict | None = None):
        self.tools = tools or {}
        self.in_call = False
        self.held = ""            # partial `<tool_call>` tag (outside) or the block so far (inside)
        self.ws = ""              # trailing whitespace of the content, held until decided
        self.n_calls = 0
        self.after_call = False   # drop whitespace that follows a tool call

    def _content(self, out, text: str):
        if self.after_call:
            text = text.lstrip()
        if not text:
            return
        self.after_call = False
        stripped = text.rstrip()
        if not stripped:
            self.ws += text
            return
        body = self.ws + stripped
        self.ws = text[len(stripped):]
        if out and out[-1][0] == "content":
            out[-1] = ("content", out[-1][1] + body)
        else:
            out.append(("content", body))

    def _call(self, out, call: dict):
        self.ws, self.after_call = "", True
        out.append(("tool_call", {"index": self.n_calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": call["name"],
                                               "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}))
        self.n_calls += 1

    def feed(self, delta: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        buf = self.held + delta
        self.held = ""
        while buf:
            if not self.in_call:
                i = buf.find(CALL_OPEN)
                if i < 0:
                    keep = _partial_suffix(buf, CALL_OPEN)
                    self._content(out, buf[:len(buf) - keep])
                    self.held = buf[len(buf) - keep:]
                    return out
                self._content(out, buf[:i])
                buf = buf[i + len(CALL_OPEN):]
                self.in_call = True
            else:
                i = buf.find(CALL_CLOSE)
                if i < 0:
                    self.held = buf
                    return out
                block, buf = buf[:i], buf[i + len(CALL_CLOSE):]
                self.in_call = False
                self._block(out, block, closed=True)
        return out

    def _block(self, out, block: str, closed: bool):
        calls = parse_tool_block(block, self.tools)
        if calls is None:       # malformed: give the text back untouched
            self._content(out, CALL_OPEN + block + (CALL_CLOSE if closed else ""))
            return
        for c in calls:
            self._call(out, c)

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        if self.in_call:
            self.in_call = False
            block, self.held = self.held, ""
            self._block(out, block, closed=False)
        else:
            self._content(out, self.held)
            self.held = ""
        if self.ws and not self.n_calls:
            out.append(("content", self.ws))
        self.ws = ""
        return out


def parse_tool_calls(text: str, tools: dict | None = None) -> tuple[str | None, list[dict]]:
    """Whole text -> (content or None, tool_calls in OpenAI form)."""
    p = ToolCallParser(tools)
    parts = p.feed(text) + p.finish()
    content = "".join(x for k, x in parts if k == "content")
    calls = [x for k, x in parts if k == "tool_call"]
    for c in calls:
        c.pop("index", None)
    return content or None, calls
