"""Text of an artifact: tokenizer (the `tokenizers` library over the artifact's tokenizer.json), chat
template (tokenizer_config.json `chat_template` or chat_template.jinja, rendered in a jinja2 *sandboxed*
environment: a template is data that came with a checkpoint, not trusted code), and an
incremental detokenizer that never emits half a UTF-8 character. It lives in runtime/ (jinja2 and
tokenizers, no HTTP) because two callers share it: the Python text API (runtime/text.py) and the HTTP
server (server/), so `Engine.generate_text` works where the server's packages are not installed.

Contract: `TextCodec.from_artifact(dir)` fails loudly (FileNotFoundError) without tokenizer.json;
`encode(str) -> list[int]`, `render_chat(messages, tools) -> str` raise ValueError on input the
template or tokenizer rejects (the HTTP layer turns that into a 400).
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False, separators=None):
    # HF templates call tojson with keyword args jinja's builtin filter does not take
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys, separators=separators)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def _check_text(s: str, what: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid unicode (lone surrogate)") from None
    return s


def _flatten_content(content):
    """OpenAI content parts -> one string when every part is text (what simple templates expect);
    None stays None. Non-text parts are rejected: this server has no vision/audio inputs."""
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
        texts.append(part["text"])
    return "".join(texts)


def _prepare_message(m: dict) -> dict:
    m = dict(m)
    m["content"] = _flatten_content(m.get("content"))
    if m.get("tool_calls"):
        calls = []
        for c in m["tool_calls"]:
            c = json.loads(json.dumps(c))
            fn = c.get("function") or {}
            args = fn.get("arguments")
            if isinstance(args, str):
                # Qwen templates iterate `arguments|items`: give them the mapping, not the JSON text
                try:
                    parsed = json.loads(args)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    fn["arguments"] = parsed
            calls.append(c)
        m["tool_calls"] = calls
    return m


class TextCodec:
    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, special: dict):
        self.tok = tokenizer
        self.chat_template = chat_template
        self.special = special                 # bos_token / eos_token strings for the template
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                  extensions=["jinja2.ext.loopcontrols"])
        self._env.filters["tojson"] = _tojson
        self._env.globals["raise_exception"] = _raise_exception
        self._env.globals["strftime_now"] = _strftime_now
        self._template = self._env.from_string(chat_template) if chat_template else None

    @classmethod
    def from_artifact(cls, root: str | Path) -> "TextCodec":
        root = Path(root)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"{tj} is missing: the server needs the checkpoint's tokenizer")
        cfg = {}
        if (root / "tokenizer_config.json").is_file():
            cfg = json.loads((root / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if isinstance(template, list):         # HF's named-template form: [{"name":..., "template":...}]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()

        def tok_str(v):
            return v.get("content") if isinstance(v, dict) else v
        special = {"bos_token": tok_str(cfg.get("bos_token")) or "", "eos_token": tok_str(cfg.get("eos_token")) or ""}
        return cls(Tokenizer.from_file(str(tj)), template, special)

    # ---- encode / decode ----
    def encode(self, text: str) -> list[int]:
        _check_text(text, "prompt")
        # the template already wrote any special tokens as text: no extra BOS/EOS here
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: dict | None = None) -> str:
        if self._template is None:
            raise ValueError("this model has no chat template: use /v1/completions")
        msgs = [_prepare_message(m) for m in messages]
        _check_text(json.dumps(msgs, ensure_ascii=False), "messages")
        if tools:
            _check_text(json.dumps(tools, ensure_ascii=False), "tools")
        try:
            return self._template.render(messages=msgs, tools=tools or None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special, **(template_kwargs or {}))
        except TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from None
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"chat template failed on the messages: {type(e).__name__}: {e}") from None


class IncrementalDetokenizer:
    """Token ids in, text deltas out. Decodes a short window of recent ids and emits only text
    that is final: a window ending in U+FFFD (an incomplete multi-byte char) waits for more ids.
    Uses the prefix/read offset scheme (as vLLM/TGI) so the cost per token is O(window)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: list[int] = []
        self.prefix = 0          # ids[prefix:read] decode to text already emitted
        self.read = 0

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        prefix_text = self.codec.decode(self.ids[self.prefix:self.read])
        full = self.codec.decode(self.ids[self.prefix:])
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return full[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end: whatever is held (an invalid byte sequence decodes to U+FFFD)."""
        prefix_text = self.codec.decode(self.ids[self.prefix:self.read])
        full = self.codec.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return full[len(prefix_text):] if len(full) > len(prefix_text) else ""
