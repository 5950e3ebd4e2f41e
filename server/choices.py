"""One choice's text pipeline, and the response bodies built from finished choices.

A request asks for `n` choices; each is one engine request. Per generated token id:
detokenize incrementally -> stop strings -> (chat) reasoning split -> tool calls, giving
parts `(kind, payload)` with kind "content" | "reasoning" | "tool_call" (a streaming delta).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

from onegraph.runtime.codec import IncrementalDetokenizer, TextCodec

from .parsers import ChatOutputParser, merge_tool_delta
from .schema import ApiError
from .stops import StopMatcher


@dataclasses.dataclass
class Job:
    """What a request asks the engine for, after validation."""
    kind: str                      # "chat" | "completion"
    prompt_ids: list[int]
    max_tokens: int
    n: int
    sampling: dict                 # Engine.submit's temperature, top_k, top_p
    seed: int | None
    stops: list[str]
    stop_ids: tuple
    stream: bool
    include_usage: bool
    return_token_ids: bool
    in_think: bool | None = None   # chat: reasoning parser on; True when the prompt opened <think>
    tools: dict | None = None      # chat: tool-call parser on (function name -> parameters schema)

    def usage(self, choices: list[Choice]) -> dict:
        """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens the engine's prefix cache
        supplied, the least over the n choices (the prompt counts once)."""
        gen = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": len(self.prompt_ids), "completion_tokens": gen,
                "total_tokens": len(self.prompt_ids) + gen,
                "prompt_tokens_details": {"cached_tokens": min((c.cached_tokens for c in choices), default=0)}}


@dataclasses.dataclass
class Choice:
    index: int
    detok: IncrementalDetokenizer
    stop: StopMatcher
    parser: ChatOutputParser | None    # chat; None for completions (text as is)
    rid: int = -1                      # the engine's request id
    token_ids: list = dataclasses.field(default_factory=list)
    finish: str | None = None
    t_first: float | None = None
    t_last: float | None = None
    cached_tokens: int = 0             # prompt tokens the engine's prefix cache supplied (its events say)
    # accumulated (non-stream)
    text: list = dataclasses.field(default_factory=list)
    reasoning: list = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)

    @classmethod
    def open(cls, index: int, job: Job, codec: TextCodec) -> Choice:
        parser = ChatOutputParser(job.in_think, job.tools) if job.kind == "chat" else None
        return cls(index, IncrementalDetokenizer(codec), StopMatcher(job.stops), parser)

    def pipe(self, text: str, final: bool) -> list[tuple[str, Any]]:
        """Released text -> [(kind, payload)] through the reasoning and tool-call parsers."""
        if self.parser is not None:
            return self.parser.feed(text, final)
        return [("content", text)] if text else []

    def on_token(self, tok: int) -> tuple[list, bool]:
        now = time.perf_counter()
        self.t_first = self.t_first or now
        self.t_last = now
        self.token_ids.append(tok)
        out, stopped = self.stop.feed(self.detok.push(tok))
        return self.pipe(out, final=stopped), stopped

    def on_end(self) -> list:
        tail, stopped = self.stop.feed(self.detok.flush())
        if stopped:
            self.finish = "stop"
        return self.pipe(tail + self.stop.flush(), final=True)

    def record(self, parts):
        for kind, x in parts:
            if kind == "tool_call":                # streaming deltas -> whole calls
                merge_tool_delta(self.calls, x)
            else:
                {"content": self.text, "reasoning": self.reasoning}[kind].append(x)

    def error(self) -> ApiError | None:
        if self.finish == "cancelled":
            return ApiError(503, "request cancelled (server shutting down)", type_="server_error", code="cancelled")
        if self.finish == "error":
            return ApiError(500, "the engine failed while generating", type_="server_error", code="engine_error")
        return None

    def openai_finish(self) -> str:
        # a call cut short by max_tokens keeps "length": its arguments are not complete
        called = self.calls or self.parser is not None and self.parser.n_calls
        return "tool_calls" if called and self.finish != "length" else self.finish


def full_body(job: Job, choices: list[Choice], rid: str, model: str) -> dict:
    """A non-stream response from finished choices."""
    out = []
    for c in choices:
        if job.kind == "chat":
            content = "".join(c.text)
            msg = {"role": "assistant", "content": content if content or not c.calls else None}
            if c.parser is not None and c.parser.reason is not None and c.reasoning:
                msg["reasoning_content"] = "".join(c.reasoning).rstrip("\n")
            if c.calls:
                msg["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in c.calls]
            ch = {"index": c.index, "message": msg, "logprobs": None, "finish_reason": c.openai_finish()}
        else:
            ch = {"index": c.index, "text": "".join(c.text), "logprobs": None, "finish_reason": c.finish}
        if job.return_token_ids:
            ch["token_ids"] = list(c.token_ids)
        out.append(ch)
    body = {"id": rid, "object": "chat.completion" if job.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": out, "usage": job.usage(choices)}
    if job.return_token_ids:
        body["prompt_token_ids"] = list(job.prompt_ids)
    return body
