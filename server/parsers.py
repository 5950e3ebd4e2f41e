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
and a non-streamed one never disagree. Every decision looks only at text already received and
waits (holds text back) while the text so far cannot decide it; `finish()` decides what is left
as "the output ends here".

Kinds: "reasoning" (str), "content" (str), "tool_call" (a delta in OpenAI streaming form: the first
delta of a call carries index, id, type, name and `arguments: ""`; later ones carry index and an
`arguments` piece; the pieces concatenate to the call's JSON arguments). `merge_tool_delta` folds
deltas into complete calls.

Which tags are structure and which are text inside a parameter value (code that writes parsers or
templates puts `</parameter>` or a whole `<tool_call>` block into a value):
- `</parameter>` closes the value only when whitespace and then a new parameter of this function
  (`<parameter=NAME>`, NAME declared in the tool's schema and not yet given) or the function's end
  follows; otherwise it is text.
- A `<parameter=NAME>` for such a new parameter closes the open value even without `</parameter>`.
- `</function>` closes the call (and the value) when whitespace and then `</tool_call>`, another
  `<function=NAME>` or the end of the output follows.
- A `<tool_call>` followed by `<function=` inside a value opens a nested literal block: tags up to
  its matching `</tool_call>` are text.
A block that does not start with `<tool_call>`, whitespace, `<function=NAME>`, whitespace and then
`<parameter=NAME>` or `</function>` is not a call: it is passed through as text. A call is
committed (its name streamed) once that head is seen; a call the output cuts short is closed with
the arguments seen so far (the finish reason says "length").
"""
from __future__ import annotations

import ast
import json
import re
import uuid

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FN_OPEN, FN_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
_TAGS = (CALL_OPEN, CALL_CLOSE, FN_OPEN, FN_CLOSE, PARAM_OPEN, PARAM_CLOSE)

_WS = " \t\r\n"
_NAME = re.compile(r"[^\s<>{}\"'=]+")   # function/parameter names: no whitespace, tags, quotes, templating
_MAX_NAME = 256
YES, MORE, NO = "yes", "more", "no"


def _partial_suffix(buf: str, tag: str) -> int:
    """Length of the longest suffix of buf that is a proper prefix of tag."""
    for k in range(min(len(tag) - 1, len(buf)), 0, -1):
        if buf.endswith(tag[:k]):
            return k
    return 0


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def _match(s: str, i: int, lit: str) -> str:
    """YES when s[i:] starts with lit, MORE when s[i:] is a proper prefix of it (more text may
    complete it), NO otherwise."""
    seg = s[i:i + len(lit)]
    if seg == lit:
        return YES
    return MORE if lit.startswith(seg) else NO


def _tag(s: str, i: int, head: str):
    """`<head NAME>` at s[i:] -> (NAME, index after '>'), or MORE / NO. NO only when no further text
    can make it a valid tag, so waiting on MORE never changes the answer."""
    m = _match(s, i, head)
    if m != YES:
        return m
    j = i + len(head)
    k = s.find(">", j, j + _MAX_NAME + 1)
    seg = s[j:k] if k >= 0 else s[j:j + _MAX_NAME + 1]
    name = seg.strip()
    if name and not _NAME.fullmatch(name):
        return NO
    if k < 0:
        return NO if len(seg) > _MAX_NAME else MORE
    return (name, k + 1) if name else NO


# ---------------------------------------------------------------- parameter values
_TYPE_ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number", "double": "number",
                 "bool": "boolean", "dict": "object", "list": "array", "tuple": "array"}


def schema_types(schema) -> tuple[list[str], bool]:
    """A parameter's JSON schema -> (its non-null types in declared order, nullable). Follows
    `type` (a string or a list), `anyOf` / `oneOf` / `allOf` (nested, as pydantic writes
    `Optional[T]`), `nullable`, and infers from `enum` / `const` / `properties` / `items`."""
    types: list[str] = []
    nullable = False

    def add(t: str):
        nonlocal nullable
        t = _TYPE_ALIASES.get(t.lower(), t.lower())
        if t == "null":
            nullable = True
        elif t not in types:
            types.append(t)

    def of_value(v) -> str:
        if v is None:
            return "null"
        if isinstance(v, bool):
            return "boolean"
        if isinstance(v, int):
            return "integer"
        if isinstance(v, float):
            return "number"
        return "string" if isinstance(v, str) else "object" if isinstance(v, dict) else "array"

    def walk(s, depth: int):
        nonlocal nullable
        if not isinstance(s, dict) or depth > 16:
            return
        t = s.get("type")
        named = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] if isinstance(t, list) else []
        for x in named:
            add(x)
        if s.get("nullable") is True:
            nullable = True
        for key in ("anyOf", "oneOf", "allOf"):
            if isinstance(s.get(key), list):
                for sub in s[key]:
                    walk(sub, depth + 1)
        if not named:
            if isinstance(s.get("enum"), list):
                for v in s["enum"]:
                    add(of_value(v))
            elif "const" in s:
                add(of_value(s["const"]))
            elif isinstance(s.get("properties"), dict):
                add("object")
            elif "items" in s:
                add("array")

    walk(schema, 0)
    return types, nullable


def _no_constant(name):
    raise ValueError(f"not JSON: {name}")


def _json_or_missing(s: str):
    try:
        return json.loads(s, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return _MISSING


def _container(s: str, want: type):
    """JSON text, JSON text double-encoded as a string, or a Python literal (single quotes, True,
    None: what models trained on `str(dict)` write) -> a dict/list of the wanted kind, or _MISSING."""
    v = _json_or_missing(s)
    if isinstance(v, str):                      # '"{\'a\': 1}"': a string holding the container
        s = v
        v = _json_or_missing(s)
    if v is _MISSING:
        try:
            v = ast.literal_eval(s)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _MISSING
    return v if isinstance(v, want) else _MISSING


_MISSING = object()
_INT = re.compile(r"[-+]?[0-9]+")
_NUM = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _as_type(raw: str, s: str, t: str):
    if t == "string":
        return raw
    if t == "integer" and _INT.fullmatch(s):
        return int(s)
    if t == "number" and _NUM.fullmatch(s):
        return int(s) if _INT.fullmatch(s) else float(s)
    if t == "boolean" and s.lower() in ("true", "false"):
        return s.lower() == "true"
    if t in ("object", "array"):
        return _container(s, dict if t == "object" else list)
    return _MISSING


def convert_value(raw: str, schema) -> object:
    """A parameter's text -> a JSON value, guided by the tool's JSON schema: the first declared type
    the text reads as wins (so `anyOf: [string, null]` keeps "42" a string), "null"/"None" is null
    for a nullable parameter, and text that fits no type stays a string."""
    types, nullable = schema_types(schema)
    s = raw.strip()
    if nullable and s in ("null", "None"):
        return None
    if not types:                           # no schema: numbers, booleans, objects stay typed
        v = _json_or_missing(s)
        return raw if v is _MISSING else v
    for t in types:
        v = _as_type(raw, s, t)
        if v is not _MISSING:
            try:                            # a Python literal may hold what JSON cannot (sets, inf)
                json.dumps(v, allow_nan=False)
                return v
            except (TypeError, ValueError):
                continue
    return None if s == "null" else raw


def _strip_one_nl(s: str) -> str:
    """The template writes a value as `<parameter=p>\\nVALUE\\n</parameter>`: drop those two newlines."""
    if s.startswith("\n"):
        s = s[1:]
    if s.endswith("\n"):
        s = s[:-1]
    return s


def tool_schemas(tools: list[dict] | None) -> dict:
    """OpenAI `tools` -> {function name: parameters schema}."""
    out = {}
    for t in tools or []:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    return out


def merge_tool_delta(calls: list[dict], d: dict):
    """Fold one "tool_call" delta into `calls` (complete calls in OpenAI form, with "index")."""
    if "id" in d:
        calls.append({"index": d["index"], "id": d["id"], "type": d["type"],
                      "function": {"name": d["function"]["name"], "arguments": d["function"]["arguments"]}})
        return
    for c in reversed(calls):
        if c["index"] == d["index"]:
            c["function"]["arguments"] += d["function"]["arguments"]
            return
    raise ValueError(f"tool_call delta for index {d['index']} before its first delta")


# ---------------------------------------------------------------- tool calls
CONTENT, OPEN, BODY, VALUE, AFTER_FN = "content", "open", "body", "value", "after_fn"


class ToolCallParser:
    """Content text in -> content deltas and tool-call deltas out. The name is sent as soon as a
    call's head is seen; string arguments stream as they are decided; other types are sent whole
    when their parameter closes. Whitespace around tool calls is dropped; with no tool calls the
    content passes through byte for byte.

    `one_call=True` parses a single block whose `<tool_call>` was already consumed (a call inside
    `<think>`) and stops after it: `done` is then set, `rejected` says it was not a call, and `buf`
    holds the text after it. `counter` is the parser whose `n_calls` numbers the calls."""

    def __init__(self, tools: dict | None = None, one_call: bool = False, counter: "ToolCallParser | None" = None):
        self.tools = tools or {}
        self.mode = OPEN if one_call else CONTENT
        self.buf = ""             # text received and not yet decided
        self.ws = ""              # trailing whitespace of the content, held until decided
        self.after_call = False   # drop whitespace that follows a tool call
        self.n_calls = 0
        self.counter = counter or self
        self.one_call, self.done, self.rejected = one_call, False, False
        self.idx = -1

    # ---- driving
    def feed(self, delta: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self.buf += delta
        self._run(out, final=False)
        return out

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        self._run(out, final=True)
        if not self.one_call:
            if self.ws and not self.n_calls:
                out.append(("content", self.ws))
            self.ws = ""
        return out

    def _run(self, out, final: bool):
        step = {CONTENT: self._content, OPEN: self._open, BODY: self._body, VALUE: self._value,
                AFTER_FN: self._after_fn}
        while not self.done and step[self.mode](out, final):
            pass

    def _to_content(self):
        if self.one_call:
            self.done = True
        self.mode = CONTENT

    # ---- emitting
    def _text(self, out, text: str):
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

    def _args(self, out, piece: str):
        last = out[-1][1] if out and out[-1][0] == "tool_call" else None
        if last is not None and last["index"] == self.idx:
            last["function"]["arguments"] += piece
        else:
            out.append(("tool_call", {"index": self.idx, "function": {"arguments": piece}}))

    def _start_call(self, out, name: str):
        self.ws = ""
        self.idx = self.counter.n_calls
        self.counter.n_calls += 1
        if self.counter is not self:
            self.n_calls += 1
        self.fn = name
        schema = self.tools.get(name) or {}
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        self.props = props
        self.known = set(props) or None    # None: no schema to tell a real parameter from text
        self.used: set[str] = set()
        self.nargs = 0
        out.append(("tool_call", {"index": self.idx, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                  "function": {"name": name, "arguments": ""}}))

    def _close_call(self, out):
        self._args(out, "}" if self.nargs else "{}")
        self.after_call = True

    # ---- block head: ws <function=NAME> ws (<parameter=P> | </function>)
    def _head(self, s: str, i: int):
        """-> (NAME, index after `<function=NAME>`), MORE or NO."""
        r = _tag(s, i, FN_OPEN)
        if not isinstance(r, tuple):
            return r
        k = _skip_ws(s, r[1])
        p = _tag(s, k, PARAM_OPEN)
        if isinstance(p, tuple) or _match(s, k, FN_CLOSE) == YES:
            return r
        return MORE if MORE in (p, _match(s, k, FN_CLOSE)) else NO

    def _content(self, out, final: bool) -> bool:
        i = self.buf.find(CALL_OPEN)
        if i < 0:
            keep = 0 if final else _partial_suffix(self.buf, CALL_OPEN)
            self._text(out, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        self._text(out, self.buf[:i])
        self.buf = self.buf[i + len(CALL_OPEN):]
        self.mode = OPEN
        return True

    def _open(self, out, final: bool) -> bool:
        h = self._head(self.buf, _skip_ws(self.buf, 0))
        if h == MORE and not final:
            return False
        if isinstance(h, tuple):
            self._start_call(out, h[0])
            self.buf = self.buf[h[1]:]
            self.mode = BODY
            return True
        if self.one_call:                  # not a call: the caller keeps the text
            self.done = self.rejected = True
            return False
        self._text(out, CALL_OPEN)         # not a call: the tag is text, the rest is scanned again
        self.mode = CONTENT
        return True

    def _body(self, out, final: bool) -> bool:
        i = _skip_ws(self.buf, 0)
        p = _tag(self.buf, i, PARAM_OPEN)
        if isinstance(p, tuple):
            self._open_value(p[0])
            self.buf = self.buf[p[1]:]
            self.mode = VALUE
            return True
        f = _match(self.buf, i, FN_CLOSE)
        if f == YES:
            self.buf = self.buf[i + len(FN_CLOSE):]
            self.mode = AFTER_FN
            return True
        if MORE in (p, f) and not final:
            return False
        self._close_call(out)              # the output ended (or cannot go on as this call)
        self.buf = self.buf[i:]
        self._to_content()
        return True

    def _after_fn(self, out, final: bool) -> bool:
        i = _skip_ws(self.buf, 0)
        c = _match(self.buf, i, CALL_CLOSE)
        h = self._head(self.buf, i) if c == NO else NO
        if MORE in (c, h) and not final:
            return False
        self._close_call(out)
        if c == YES:
            self.buf = self.buf[i + len(CALL_CLOSE):]
            self._to_content()
        elif isinstance(h, tuple):         # a second function in the same block
            self._start_call(out, h[0])
            self.buf = self.buf[h[1]:]
            self.mode = BODY
        else:
            self.buf = self.buf[i:]
            self._to_content()
        return True

    # ---- a parameter value
    def _open_value(self, name: str):
        self.pname = name
        self.used.add(name)
        self.pschema = self.props.get(name)
        types, self.nullable = schema_types(self.pschema)
        self.stream_str = bool(types) and types[0] == "string"   # the value will be this text verbatim
        self.parts: list[str] = []    # value text decided so far (typed values: converted at the end)
        self.lead = True              # the value's first newline (the template's) is still to drop
        self.pending = ""             # string value: decided, not yet streamed (a trailing newline waits)
        self.opened = False           # string value: key and opening quote sent
        self.nest = 0                 # nested literal <tool_call> blocks open inside the value

    def _lit(self, text: str):
        if not text:
            return
        if not self.stream_str:
            self.parts.append(text)
            return
        if self.lead:
            self.lead = False
            text = text[1:] if text.startswith("\n") else text
        self.pending += text

    def _key(self) -> str:
        prefix = "{" if self.nargs == 0 else ", "
        self.nargs += 1
        return prefix + json.dumps(self.pname, ensure_ascii=False) + ": "

    def _stream_value(self, out):
        """Send what is certain of a string value: all but a trailing newline (the template's) and,
        for a nullable one, nothing while it may still read "null"/"None"."""
        if not self.stream_str:
            return
        send = self.pending[:-1] if self.pending.endswith("\n") else self.pending
        if not send:
            return
        if not self.opened:
            s = send.strip()
            if self.nullable and ("null".startswith(s) or "None".startswith(s)):
                return
            self._args(out, self._key() + '"')
            self.opened = True
        self._args(out, json.dumps(send, ensure_ascii=False)[1:-1])
        self.pending = self.pending[len(send):]

    def _end_value(self, out):
        if self.stream_str:
            value = self.pending[:-1] if self.pending.endswith("\n") else self.pending
            if self.opened:
                self._args(out, json.dumps(value, ensure_ascii=False)[1:-1] + '"')
                return
        else:
            value = _strip_one_nl("".join(self.parts))
        v = convert_value(value, self.pschema)
        self._args(out, self._key() + json.dumps(v, ensure_ascii=False))

    def _new_param(self, name: str) -> bool:
        """Could `<parameter=name>` start this call's next parameter (rather than be text)?"""
        return name not in self.used and (self.known is None or name in self.known)

    def _fn_end(self, s: str, i: int, final: bool) -> str:
        """Is the `</function>` at s[i] the call's end: whitespace, then `</tool_call>`, another
        function, or the end of the output?"""
        j = _skip_ws(s, i + len(FN_CLOSE))
        if j == len(s):
            return YES if final else MORE
        c = _match(s, j, CALL_CLOSE)
        h = self._head(s, j) if c == NO else NO
        if c == YES or isinstance(h, tuple):
            return YES
        return MORE if MORE in (c, h) and not final else NO

    def _decide(self, s: str, i: int, final: bool):
        """s[i] is '<' inside a value -> ("text", n) | ("close", n) | ("next", 0) | ("fn_end", n) |
        MORE. n: chars consumed from i."""
        rest = len(s) - i
        if rest < len(PARAM_CLOSE) and any(rest < len(t) and t.startswith(s[i:]) for t in _TAGS):
            return ("text", 1) if final else MORE
        if self.nest:
            if s.startswith(CALL_CLOSE, i):
                self.nest -= 1
                return ("text", len(CALL_CLOSE))
        elif s.startswith(PARAM_CLOSE, i):
            j = _skip_ws(s, i + len(PARAM_CLOSE))
            if j == len(s):
                return ("close", j - i) if final else MORE
            p = _tag(s, j, PARAM_OPEN)
            if isinstance(p, tuple):
                return ("close", j - i) if self._new_param(p[0]) else ("text", len(PARAM_CLOSE))
            f = _match(s, j, FN_CLOSE)
            if f == YES:
                f = self._fn_end(s, j, final)
            if f == YES:
                return ("fn_end", j + len(FN_CLOSE) - i)
            if MORE in (p, f) and not final:
                return MORE
            return ("text", len(PARAM_CLOSE))
        elif s.startswith(PARAM_OPEN, i):
            p = _tag(s, i, PARAM_OPEN)
            if p == MORE:
                return ("text", 1) if final else MORE
            if isinstance(p, tuple) and self._new_param(p[0]):
                return ("next", 0)
            return ("text", p[1] - i if isinstance(p, tuple) else 1)
        elif s.startswith(FN_CLOSE, i):
            f = self._fn_end(s, i, final)
            if f == MORE:
                return MORE
            return ("fn_end", len(FN_CLOSE)) if f == YES else ("text", len(FN_CLOSE))
        if s.startswith(CALL_OPEN, i):          # a whole call written as text opens a nested block
            m = _match(s, _skip_ws(s, i + len(CALL_OPEN)), FN_OPEN)
            if m == MORE and not final:
                return MORE
            self.nest += m == YES
            return ("text", len(CALL_OPEN))
        return ("text", 1)

    def _value(self, out, final: bool) -> bool:
        s, i = self.buf, 0                      # scan by index: one slice per call, not per tag
        while True:
            j = s.find("<", i)
            if j < 0:
                self._lit(s[i:])
                i = len(s)
                if not final:
                    self.buf = ""
                    self._stream_value(out)
                    return False
                d = ("close", 0)
            else:
                self._lit(s[i:j])
                i = j
                d = self._decide(s, i, final)
            if d == MORE:
                self.buf = s[i:]
                self._stream_value(out)
                return False
            kind, n = d
            if kind == "text":
                self._lit(s[i:i + n])
                i += n
                continue
            self.buf = s[i + n:]
            self._stream_value(out)
            self._end_value(out)
            self.mode = AFTER_FN if kind == "fn_end" else BODY
            return True


def parse_tool_calls(text: str, tools: dict | None = None) -> tuple[str | None, list[dict]]:
    """Whole text -> (content or None, tool_calls in OpenAI form)."""
    p = ToolCallParser(tools)
    parts = p.feed(text) + p.finish()
    content = "".join(x for k, x in parts if k == "content")
    return content or None, _whole_calls(parts)


def _whole_calls(parts: list[tuple[str, object]]) -> list[dict]:
    """A parser's (kind, piece) parts -> the tool calls in OpenAI form (deltas merged, stream indices dropped)."""
    calls: list[dict] = []
    for k, x in parts:
        if k == "tool_call":
            merge_tool_delta(calls, x)
    for c in calls:
        c.pop("index")
    return calls


# ---------------------------------------------------------------- reasoning
class ReasoningParser:
    """Splits `<think>…</think>` into reasoning. `in_think=True` when the prompt already opened
    the block (Qwen3.5 templates end the generation prompt with `<think>\\n`); a `<think>` the model
    writes again at the start is then dropped. With `tools` (the response's ToolCallParser), a
    `<tool_call>` block inside the reasoning is parsed as a call (Qwen3.5/3.6 emit calls there)
    and the reasoning goes on after it."""

    def __init__(self, in_think: bool = False, tools: ToolCallParser | None = None):
        self.in_think = in_think
        self.tools = tools
        self.held = ""
        self.strip_nl = in_think          # drop newlines right after a tag
        self.seen_think = in_think
        self.at_start = in_think          # the output may repeat the prompt's <think>
        self.sub: ToolCallParser | None = None

    def feed(self, delta: str) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        buf, self.held = self.held + delta, ""
        self._scan(out, buf, final=False)
        return out

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        buf, self.held = self.held, ""
        self._scan(out, buf, final=True)
        return out

    def _scan(self, out, buf: str, final: bool):
        while True:
            if self.sub is not None:       # inside a tool call that opened within <think>
                out += self.sub.feed(buf)
                buf = ""
                if final and not self.sub.done:
                    out += self.sub.finish()
                if not self.sub.done:
                    return
                buf, rejected, self.sub = self.sub.buf, self.sub.rejected, None
                if rejected:
                    self._emit(out, CALL_OPEN)
                else:
                    self.strip_nl = True
                continue
            if self.at_start:
                s = buf.lstrip()
                if len(s) < len(THINK_OPEN) and THINK_OPEN.startswith(s) and not final:
                    self.held = buf
                    return
                self.at_start = False
                if s.startswith(THINK_OPEN):
                    buf = s[len(THINK_OPEN):]
                continue
            tags = [THINK_CLOSE if self.in_think else THINK_OPEN]
            if self.in_think and self.tools is not None:
                tags.append(CALL_OPEN)
            hits = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
            if hits:
                i, tag = min(hits)
                self._emit(out, buf[:i])
                buf = buf[i + len(tag):]
                if tag == CALL_OPEN:
                    self.sub = ToolCallParser(self.tools.tools, one_call=True, counter=self.tools)
                    continue
                self.in_think = not self.in_think
                self.seen_think = True
                self.strip_nl = True
                continue
            keep = 0 if final else max(_partial_suffix(buf, t) for t in tags)
            self._emit(out, buf[:len(buf) - keep])
            self.held = buf[len(buf) - keep:]
            return

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


def split_reasoning(text: str, in_think: bool = False) -> tuple[str | None, str | None]:
    """Whole text -> (reasoning_content or None, content or None)."""
    p = ReasoningParser(in_think)
    parts = p.feed(text) + p.finish()
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    return (reasoning.rstrip("\n") or None) if p.seen_think else None, content or None


class ChatOutputParser:
    """The whole chat pipeline for one choice: reasoning split, then tool calls (also those inside
    the reasoning). `tools=None` turns tool parsing off, `in_think=None` the reasoning split."""

    def __init__(self, in_think: bool | None, tools: dict | None):
        self.tools = ToolCallParser(tools) if tools is not None else None
        self.reason = ReasoningParser(in_think, self.tools) if in_think is not None else None

    def feed(self, text: str, final: bool = False) -> list[tuple[str, object]]:
        parts: list[tuple[str, object]] = [("content", text)] if text else []
        if self.reason is not None:
            parts = (self.reason.feed(text) if text else []) + (self.reason.finish() if final else [])
        if self.tools is not None:
            out: list[tuple[str, object]] = []
            for kind, x in parts:
                out += self.tools.feed(x) if kind == "content" else [(kind, x)]
            parts = out + (self.tools.finish() if final else [])
        return [(k, x) for k, x in parts if k == "tool_call" or x]

    @property
    def n_calls(self) -> int:
        return self.tools.n_calls if self.tools is not None else 0


def parse_chat_output(text: str, in_think: bool | None, tools: dict | None):
    """Whole text -> (reasoning or None, content or None, tool_calls in OpenAI form)."""
    p = ChatOutputParser(in_think, tools)
    parts = p.feed(text, final=True)
    reasoning = "".join(x for k, x in parts if k == "reasoning").rstrip("\n")
    content = "".join(x for k, x in parts if k == "content")
    return reasoning or None, content or None, _whole_calls(parts)
