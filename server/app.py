"""OpenAI-compatible HTTP API over one runtime Engine.

`create_app(engine, served_model_name, api_key=None)` -> FastAPI app with
  GET  /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /health,
  GET  /metrics (Prometheus).

The server owns text; the engine sees token ids only, through `submit` (an emit callback per
request, called on the engine thread and bounced into the event loop), `cancel` and `stats`.
Per generated token: detokenize incrementally -> stop strings -> reasoning split -> tool calls.

Errors are OpenAI-shaped `{"error": {"message", "type", "param", "code"}}`: 400 for anything the
client sent wrong (bad JSON, types, ranges, unknown model, too long), 401 for the API key, 503
with Retry-After for a full queue or a draining server, 500 for a bug in one request (the engine
and the server keep running). A client that goes away has its requests cancelled: their slots are
freed at the engine's next step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import secrets
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from onegraph.runtime import QueueFull

from .metrics import CONTENT_TYPE_LATEST, Metrics
from .parsers import ChatOutputParser, merge_tool_delta, tool_schemas
from .stops import StopMatcher
from .text import IncrementalDetokenizer, TextCodec

log = logging.getLogger("onegraph.server")

DEFAULT_MAX_TOKENS = 256          # when max_tokens is absent: what fits in max_seq_len, capped here
INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1


# ------------------------------------------------------------------ errors
class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _validation_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    if err.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {err.get('msg')}", code="invalid_json")
    where = f"'{loc}': " if loc else ""
    return ApiError(400, f"{where}{err.get('msg')}", param=loc or None, code="invalid_value")


def _not_supported(param: str, what: str | None = None) -> ApiError:
    return ApiError(400, f"{what or param} is not supported by this server", param=param, code="not_supported")


# ------------------------------------------------------------------ request models
class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class _Open(BaseModel):
    """Objects passed through to the chat template keep their unknown fields."""
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class ContentPart(_Open):
    type: str
    text: str | None = None


class FunctionCall(_Open):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(_Open):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Open):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDef


class _Sampling(_Strict):
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)                        # extension; -1 and 0 both mean "all"
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    user: str | None = None
    ignore_eos: bool = False                            # extension
    return_token_ids: bool = False                      # extension: choices carry their token ids

    def check_unsupported(self):
        if self.logprobs or self.top_logprobs:
            raise _not_supported("logprobs")
        if self.presence_penalty or self.frequency_penalty:
            raise _not_supported("presence_penalty" if self.presence_penalty else "frequency_penalty",
                                 "presence/frequency penalties")
        stops = self.stop_list()
        if len(stops) > 16:
            raise ApiError(400, "at most 16 stop strings", param="stop", code="invalid_value")
        if any(len(s) > 1000 for s in stops):
            raise ApiError(400, "stop strings are limited to 1000 characters", param="stop", code="invalid_value")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (e.g. enable_thinking)
    add_generation_prompt: bool = True


# ------------------------------------------------------------------ one choice's text pipeline
@dataclasses.dataclass
class _Choice:
    index: int
    rid: int = -1
    token_ids: list = dataclasses.field(default_factory=list)
    finish: str | None = None
    t_first: float | None = None
    t_last: float | None = None
    detok: Any = None
    stop: Any = None
    parser: Any = None             # ChatOutputParser (chat) or None (completions: text as is)
    # accumulated (non-stream)
    text: list = dataclasses.field(default_factory=list)
    reasoning: list = dataclasses.field(default_factory=list)
    calls: list = dataclasses.field(default_factory=list)

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


@dataclasses.dataclass
class _Job:
    """What a request asks the engine for, after validation."""
    kind: str                      # "chat" | "completion"
    prompt_ids: list[int]
    max_tokens: int
    n: int
    sampling: dict
    seed: int | None
    stops: list[str]
    stop_ids: tuple
    stream: bool
    include_usage: bool
    return_token_ids: bool
    in_think: bool | None = None   # chat: reasoning parser on; True when the prompt opened <think>
    tools: dict | None = None      # chat: tool-call parser on (function name -> parameters schema)


# ------------------------------------------------------------------ the app
class _Server:
    def __init__(self, engine, served_model_name: str, api_key: str | None, codec: TextCodec):
        self.engine = engine
        self.name = served_model_name
        self.api_key = api_key
        self.codec = codec
        m = engine.ex.manifest
        self.max_seq_len = int(m["max_seq_len"])
        self.vocab = int(m["model"]["vocab_size"])
        self.eos_ids = tuple(int(i) for i in m["model"].get("eos_token_ids") or ())
        self.metrics = Metrics(engine)
        self.created = int(time.time())
        self.draining = False
        self.inflight: set[int] = set()           # engine request ids, for cancel_all()

    # ---- checks shared by the endpoints ----
    def auth(self, request: Request):
        if self.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not secrets.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                           type_="authentication_error", code="invalid_api_key")

    def check_open(self):
        if self.draining:
            raise ApiError(503, "server is shutting down", type_="server_error", code="unavailable",
                           headers={"Retry-After": "5"})

    async def parse(self, request: Request, model_cls):
        body = await request.body()
        try:
            req = model_cls.model_validate_json(body)
        except ValidationError as e:
            raise _validation_error(e) from None
        if req.model != self.name:
            raise ApiError(400, f"model '{req.model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")
        req.check_unsupported()
        return req

    def job(self, req: _Sampling, kind: str, prompt_ids: list[int], max_tokens: int | None) -> _Job:
        if not prompt_ids:
            raise ApiError(400, "prompt is empty", param="prompt" if kind == "completion" else "messages",
                           code="invalid_value")
        bad = [i for i in prompt_ids if not 0 <= i < self.vocab]
        if bad:
            raise ApiError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab})",
                           param="prompt", code="invalid_value")
        room = self.max_seq_len - len(prompt_ids)
        param = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) else "max_tokens"
        if max_tokens is None:
            if room < 1:
                raise ApiError(400, f"prompt is {len(prompt_ids)} tokens; this model's context is "
                                    f"{self.max_seq_len} tokens, leaving no room to generate",
                               param="messages" if kind == "chat" else "prompt", code="context_length_exceeded")
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        elif max_tokens > room:
            raise ApiError(400, f"prompt ({len(prompt_ids)} tokens) + {param} ({max_tokens}) exceeds this "
                                f"model's context of {self.max_seq_len} tokens", param=param,
                           code="context_length_exceeded")
        top_k = 0 if req.top_k <= 0 else min(req.top_k, self.vocab)
        return _Job(kind, prompt_ids, max_tokens, req.n,
                    dict(temperature=float(req.temperature), top_k=top_k, top_p=float(req.top_p)),
                    req.seed, req.stop_list(), () if req.ignore_eos else self.eos_ids, req.stream,
                    bool(req.stream_options and req.stream_options.include_usage), req.return_token_ids)

    # ---- running a job ----
    def submit(self, job: _Job, q: asyncio.Queue) -> list[_Choice]:
        """Submit the job's n requests; all or none (a failure cancels the ones already in)."""
        loop = asyncio.get_running_loop()
        choices = []
        try:
            for i in range(job.n):
                seed = None if job.seed is None else (job.seed + i - INT64_MIN) % 2 ** 64 + INT64_MIN
                parser = ChatOutputParser(job.in_think, job.tools) if job.kind == "chat" else None
                c = _Choice(i, detok=IncrementalDetokenizer(self.codec), stop=StopMatcher(job.stops), parser=parser)
                c.rid = self.engine.submit(
                    job.prompt_ids, (lambda ev, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, ev))),
                    max_new_tokens=job.max_tokens, seed=seed, stop_ids=job.stop_ids, **job.sampling)
                self.inflight.add(c.rid)
                choices.append(c)
        except QueueFull:
            self.release(choices)
            raise ApiError(503, "the server is at capacity (request queue full); retry later", type_="server_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except ValueError as e:
            self.release(choices)
            raise ApiError(400, str(e), code="invalid_value") from None
        except RuntimeError as e:
            self.release(choices)
            raise ApiError(503, f"engine unavailable: {e}", type_="server_error", code="unavailable") from None
        return choices

    def release(self, choices: list[_Choice]):
        """Cancel whatever is still running (sync: safe from a generator's finally)."""
        for c in choices:
            if c.rid in self.inflight:
                self.inflight.discard(c.rid)
                if c.finish is None:
                    self.engine.cancel(c.rid)

    def cancel_all(self):
        for rid in list(self.inflight):
            self.engine.cancel(rid)

    async def events(self, job: _Job, choices: list[_Choice], q: asyncio.Queue, request: Request | None,
                     t_start: float):
        """Yields (choice, parts) as text is released, ending each choice with its finish reason set.
        With `request`, polls for a disconnected client (non-stream responses)."""
        pending = {c.index for c in choices}
        get = None
        try:
            while pending:
                if get is None:
                    get = asyncio.ensure_future(q.get())
                if request is not None:
                    done, _ = await asyncio.wait({get}, timeout=0.5)
                    if not done:
                        if await request.is_disconnected():
                            return
                        continue
                else:
                    await asyncio.wait({get})
                i, ev = get.result()
                get = None
                c = choices[i]
                if i not in pending:
                    continue                       # the tail of a request we stopped ourselves
                if ev.token_id is not None:
                    parts, stopped = c.on_token(ev.token_id)
                    if stopped:
                        c.finish = "stop"
                        self.engine.cancel(c.rid)
                else:
                    parts = c.on_end() if ev.finish_reason in ("stop", "length") else []
                    c.finish = c.finish or ev.finish_reason
                if c.finish is not None:
                    pending.discard(i)
                    self.inflight.discard(c.rid)
                    self.metrics.observe_generation(len(job.prompt_ids), len(c.token_ids), t_start,
                                                    c.t_first, c.t_last, c.finish)
                yield c, parts
        finally:
            if get is not None:
                get.cancel()
            self.release(choices)

    def usage(self, job: _Job, choices: list[_Choice]) -> dict:
        gen = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": len(job.prompt_ids), "completion_tokens": gen,
                "total_tokens": len(job.prompt_ids) + gen}

    @staticmethod
    def finish_error(c: _Choice) -> ApiError | None:
        if c.finish == "cancelled":
            return ApiError(503, "request cancelled (server shutting down)", type_="server_error", code="cancelled")
        if c.finish == "error":
            return ApiError(500, "the engine failed while generating", type_="server_error", code="engine_error")
        return None

    @staticmethod
    def openai_finish(c: _Choice) -> str:
        # a call cut short by max_tokens keeps "length": its arguments are not complete
        called = c.calls or c.parser is not None and c.parser.n_calls
        return "tool_calls" if called and c.finish != "length" else c.finish

    # ---- responses ----
    async def run(self, request: Request, job: _Job):
        q: asyncio.Queue = asyncio.Queue()
        t_start = time.perf_counter()
        choices = self.submit(job, q)
        rid = ("chatcmpl-" if job.kind == "chat" else "cmpl-") + uuid.uuid4().hex
        if job.stream:
            return StreamingResponse(self.sse(job, choices, q, rid, t_start), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        async for c, parts in self.events(job, choices, q, request, t_start):
            c.record(parts)
        for c in choices:
            if c.finish is None:                   # client went away; nobody reads this
                return Response(status_code=499)
            err = self.finish_error(c)
            if err:
                raise err
        return JSONResponse(self.full_body(job, choices, rid))

    def full_body(self, job: _Job, choices: list[_Choice], rid: str) -> dict:
        out = []
        for c in choices:
            if job.kind == "chat":
                content = "".join(c.text)
                msg = {"role": "assistant", "content": content if content or not c.calls else None}
                if c.parser is not None and c.parser.reason is not None and c.reasoning:
                    msg["reasoning_content"] = "".join(c.reasoning).rstrip("\n")
                if c.calls:
                    msg["tool_calls"] = [{k: v for k, v in tc.items() if k != "index"} for tc in c.calls]
                ch = {"index": c.index, "message": msg, "logprobs": None, "finish_reason": self.openai_finish(c)}
            else:
                ch = {"index": c.index, "text": "".join(c.text), "logprobs": None, "finish_reason": c.finish}
            if job.return_token_ids:
                ch["token_ids"] = list(c.token_ids)
            out.append(ch)
        body = {"id": rid, "object": "chat.completion" if job.kind == "chat" else "text_completion",
                "created": int(time.time()), "model": self.name, "choices": out, "usage": self.usage(job, choices)}
        if job.return_token_ids:
            body["prompt_token_ids"] = list(job.prompt_ids)
        return body

    async def sse(self, job: _Job, choices: list[_Choice], q: asyncio.Queue, rid: str, t_start: float):
        created, chat = int(time.time()), job.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice_list, usage=None):
            body = {"id": rid, "object": obj, "created": created, "model": self.name, "choices": choice_list}
            if job.include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        def delta_choice(c, delta, finish=None):
            if chat:
                return {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": c.index, "text": delta, "logprobs": None, "finish_reason": finish}

        try:
            if chat:
                yield chunk([delta_choice(c, {"role": "assistant", "content": ""}) for c in choices])
            async for c, parts in self.events(job, choices, q, None, t_start):
                for kind, x in parts:
                    if kind == "tool_call":
                        c.calls.append(x)
                    if not chat:
                        yield chunk([delta_choice(c, x)])
                    elif kind == "tool_call":
                        yield chunk([delta_choice(c, {"tool_calls": [x]})])
                    else:
                        yield chunk([delta_choice(c, {"content" if kind == "content" else "reasoning_content": x})])
                if c.finish is not None:
                    err = self.finish_error(c)
                    if err:
                        yield f"data: {json.dumps(err.body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    last = delta_choice(c, {} if chat else "", self.openai_finish(c) if chat else c.finish)
                    if job.return_token_ids:
                        last["token_ids"] = list(c.token_ids)
                    yield chunk([last])
            if job.include_usage:
                yield chunk([], self.usage(job, choices))
            yield "data: [DONE]\n\n"
        except Exception:                          # a bug mid-stream: end this stream, keep the server
            log.exception("stream failed")
            err = ApiError(500, "internal error while streaming", type_="server_error", code="internal_error")
            yield f"data: {json.dumps(err.body())}\n\n"
            yield "data: [DONE]\n\n"


def _chat_prompt(srv: _Server, req: ChatRequest) -> tuple[list[int], bool]:
    msgs = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    try:
        text = srv.codec.render_chat(msgs, tools, req.add_generation_prompt, req.chat_template_kwargs)
        ids = srv.codec.encode(text)
    except ValueError as e:
        raise ApiError(400, str(e), param="messages", code="invalid_value") from None
    return ids, text.rstrip().endswith("<think>")


def _completion_prompt(srv: _Server, req: CompletionRequest) -> list[int]:
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise _not_supported("prompt", "a batch of several prompts")
        p = p[0]
    if isinstance(p, str):
        try:
            return srv.codec.encode(p)
        except ValueError as e:
            raise ApiError(400, str(e), param="prompt", code="invalid_value") from None
    return list(p)


class _MetricsMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would get in the way of disconnect detection):
    counts responses by endpoint and status."""
    PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"}

    def __init__(self, app, srv: _Server):
        self.app, self.srv = app, srv

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.PATHS else "other"

        async def send_wrapped(msg):
            if msg["type"] == "http.response.start":
                self.srv.metrics.requests.labels(endpoint, str(msg["status"])).inc()
            await send(msg)
        await self.app(scope, receive, send_wrapped)


def create_app(engine, served_model_name: str, api_key: str | None = None, codec: TextCodec | None = None) -> FastAPI:
    codec = codec or TextCodec.from_artifact(engine.ex.manifest["_root"])
    srv = _Server(engine, served_model_name, api_key, codec)
    app = FastAPI(title="onegraph", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = srv
    app.add_middleware(_MetricsMiddleware, srv=srv)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return ApiError(400, str(exc.errors()[:1]), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                        headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request, exc):
        log.exception("request failed", exc_info=exc)
        return ApiError(500, f"internal error: {type(exc).__name__}", type_="server_error",
                        code="internal_error").response()

    async def guarded(fn, request: Request):
        # an unexpected exception fails this request with 500; nothing escapes to kill the server
        try:
            return await fn(request)
        except ApiError as e:
            return e.response()
        except Exception as e:
            log.exception("request failed")
            return ApiError(500, f"internal error: {type(e).__name__}", type_="server_error",
                            code="internal_error").response()

    @app.get("/health")
    async def health():
        st = engine.stats()
        if st.get("error"):
            return JSONResponse({"status": "error", "error": st["error"]}, status_code=503)
        return {"status": "draining" if srv.draining else "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(srv.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        async def go(request):
            srv.auth(request)
            return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": srv.created,
                                                "owned_by": "onegraph", "max_model_len": srv.max_seq_len}]}
        return await guarded(go, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        async def go(request):
            srv.auth(request)
            srv.check_open()
            req = await srv.parse(request, CompletionRequest)
            if req.echo:
                raise _not_supported("echo")
            if req.suffix:
                raise _not_supported("suffix")
            if req.best_of not in (None, req.n):
                raise _not_supported("best_of", "best_of other than n")
            job = srv.job(req, "completion", _completion_prompt(srv, req), req.max_tokens)
            return await srv.run(request, job)
        return await guarded(go, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        async def go(request):
            srv.auth(request)
            srv.check_open()
            req = await srv.parse(request, ChatRequest)
            if req.tool_choice not in (None, "none", "auto"):
                raise _not_supported("tool_choice", "tool_choice 'required' or a named function (no "
                                                    "constrained decoding)")
            ids, in_think = _chat_prompt(srv, req)
            job = srv.job(req, "chat", ids, req.max_completion_tokens or req.max_tokens)
            job.in_think = in_think
            if req.tools and req.tool_choice != "none":
                job.tools = tool_schemas([t.model_dump(exclude_none=True) for t in req.tools])
            return await srv.run(request, job)
        return await guarded(go, request)

    return app
