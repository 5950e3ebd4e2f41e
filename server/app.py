"""OpenAI-compatible HTTP API over one runtime Engine: the server, its middleware and its routes.

`create_app(engine, served_model_name, api_key=None, max_request_bytes=...)` -> FastAPI app with
  GET  /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /health,
  GET  /metrics (Prometheus).

The server owns text; the engine sees token ids only, through `submit` (an emit callback per
request, called on the engine thread and bounced into the event loop), `cancel` and `stats`.
Request shapes and field checks: schema.py; one choice's text pipeline and response body: choices.py.

Errors are OpenAI-shaped (schema.ApiError): 400 for anything the client sent wrong (bad JSON, types,
ranges, too long, an unsupported field such as a response_format other than text, and whatever the
engine's `submit` refuses, with its message), 404 `model_not_found` for a model this server does not
serve (as OpenAI and vLLM answer), 413 for a body over the limit (limits.py, before any parsing), 401 for
the API key, 503 with Retry-After for a full queue or a draining server, 500 for a bug in one request
(the engine and the server keep running). Prompts are tokenized (and chat templates rendered) in a worker
thread, so a large prompt never stalls the event loop (/health, other streams). A client that goes away has its requests cancelled: their
slots are freed at the engine's next step.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from onegraph.runtime import QueueFull
from onegraph.runtime.checks import DEFAULT_MAX_REQUEST_BYTES
from onegraph.runtime.codec import TextCodec

from .choices import Choice, Job, full_body
from .limits import BodyLimit
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .parsers import tool_schemas
from .schema import (ApiError, ChatRequest, CompletionRequest, SamplingRequest, internal_error, not_supported,
                     validation_error)

log = logging.getLogger("onegraph.server")

DEFAULT_MAX_TOKENS = 256          # when max_tokens is absent: what fits in max_seq_len, capped here
INT64_MIN = -(2 ** 63)


class _Server:
    """One engine's HTTP side: request checks, submission of a request's n choices, the event loop's end
    of their token streams, and the JSON / SSE responses."""

    def __init__(self, engine, served_model_name: str, api_key: str | None, codec: TextCodec):
        self.engine = engine
        self.name = served_model_name
        self.api_key = api_key
        self.codec = codec
        art = engine.artifact
        self.max_seq_len = int(art.max_seq_len)
        self.eos_ids = tuple(int(i) for i in art.model.get("eos_token_ids") or ())
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
            raise validation_error(e) from None
        if req.model != self.name:
            raise ApiError(404, f"model '{req.model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")
        req.check_unsupported()
        return req

    def job(self, req: SamplingRequest, kind: str, prompt_ids: list[int], max_tokens: int | None) -> Job:
        """The request -> what to submit. The context check is the engine's length rule, said the OpenAI
        way (code context_length_exceeded, the offending param); it also sizes a missing max_tokens.
        Every other limit is left to Engine.submit (`submit` below turns its ValueError into a 400)."""
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
        return Job(kind, prompt_ids, max_tokens, req.n,
                   dict(temperature=float(req.temperature), top_k=req.engine_top_k(), top_p=float(req.top_p)),
                   req.seed, req.stop_list(), () if req.ignore_eos else self.eos_ids, req.stream,
                   bool(req.stream_options and req.stream_options.include_usage), req.return_token_ids)

    # ---- running a job ----
    def submit(self, job: Job, q: asyncio.Queue) -> list[Choice]:
        """Submit the job's n requests; all or none (a failure cancels the ones already in). Choice i
        samples with seed + i (wrapped into int64); the first goes in with the request's own seed, so the
        engine's range check sees it."""
        loop = asyncio.get_running_loop()
        choices = []
        try:
            for i in range(job.n):
                seed = job.seed if job.seed is None or i == 0 else (job.seed + i - INT64_MIN) % 2 ** 64 + INT64_MIN
                c = Choice.open(i, job, self.codec)
                c.rid = self.engine.submit(
                    job.prompt_ids, (lambda ev, i=i: loop.call_soon_threadsafe(q.put_nowait, (i, ev))),
                    max_new_tokens=job.max_tokens, seed=seed, stop_ids=job.stop_ids, **job.sampling)
                self.inflight.add(c.rid)
                choices.append(c)
        except QueueFull:
            self.release(choices)
            raise ApiError(503, "the server is at capacity (request queue full); retry later", type_="server_error",
                           code="queue_full", headers={"Retry-After": "1"}) from None
        except ValueError as e:                     # the engine's validator: the request's limits
            self.release(choices)
            raise ApiError(400, str(e), code="invalid_value") from None
        except RuntimeError as e:
            self.release(choices)
            raise ApiError(503, f"engine unavailable: {e}", type_="server_error", code="unavailable") from None
        return choices

    def release(self, choices: list[Choice]):
        """Cancel whatever is still running (sync: safe from a generator's finally)."""
        for c in choices:
            if c.rid in self.inflight:
                self.inflight.discard(c.rid)
                if c.finish is None:
                    self.engine.cancel(c.rid)

    def cancel_all(self):
        for rid in list(self.inflight):
            self.engine.cancel(rid)

    async def events(self, job: Job, choices: list[Choice], q: asyncio.Queue, request: Request | None,
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
                c.cached_tokens = ev.cached_tokens
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

    # ---- responses ----
    async def run(self, request: Request, job: Job):
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
            err = c.error()
            if err:
                raise err
        return JSONResponse(full_body(job, choices, rid, self.name))

    async def sse(self, job: Job, choices: list[Choice], q: asyncio.Queue, rid: str, t_start: float):
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
                    err = c.error()
                    if err:
                        yield f"data: {json.dumps(err.body())}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    last = delta_choice(c, {} if chat else "", c.openai_finish() if chat else c.finish)
                    if job.return_token_ids:
                        last["token_ids"] = list(c.token_ids)
                    yield chunk([last])
            if job.include_usage:
                yield chunk([], job.usage(choices))
            yield "data: [DONE]\n\n"
        except Exception:                          # a bug mid-stream: end this stream, keep the server
            log.exception("stream failed")
            err = internal_error("internal error while streaming")
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
            raise not_supported("prompt", "a batch of several prompts")
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


class _GuardedRoute(APIRoute):
    """Every route's one catch-all: an ApiError becomes its response, any other exception a logged 500
    for this request only. Caught inside the route, so the metrics middleware still counts the 500 and
    nothing escapes to the ASGI server; routing errors (404, 405) keep their own handlers."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return e.response()
            except (StarletteHTTPException, RequestValidationError):
                raise
            except Exception as e:
                log.exception("request failed")
                return internal_error(f"internal error: {type(e).__name__}").response()
        return guarded


def create_app(engine, served_model_name: str, api_key: str | None = None, codec: TextCodec | None = None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    codec = codec or TextCodec.from_artifact(engine.artifact.path)
    srv = _Server(engine, served_model_name, api_key, codec)
    app = FastAPI(title="onegraph", docs_url=None, redoc_url=None, openapi_url=None)
    app.router.route_class = _GuardedRoute             # before the routes below are added
    app.state.server = srv
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    app.add_middleware(_MetricsMiddleware, srv=srv)          # added last: outermost, so it counts the 413s

    @app.exception_handler(RequestValidationError)
    async def _validation(request, exc):
        return ApiError(400, str(exc.errors()[:1]), code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return ApiError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None,
                        headers=getattr(exc, "headers", None)).response()

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
        srv.auth(request)
        return {"object": "list", "data": [{"id": srv.name, "object": "model", "created": srv.created,
                                            "owned_by": "onegraph", "max_model_len": srv.max_seq_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        srv.auth(request)
        srv.check_open()
        req = await srv.parse(request, CompletionRequest)
        if req.echo:
            raise not_supported("echo")
        if req.suffix:
            raise not_supported("suffix")
        if req.best_of not in (None, req.n):
            raise not_supported("best_of", "best_of other than n")
        ids = await asyncio.to_thread(_completion_prompt, srv, req)
        job = srv.job(req, "completion", ids, req.max_tokens)
        return await srv.run(request, job)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        srv.auth(request)
        srv.check_open()
        req = await srv.parse(request, ChatRequest)
        if req.tool_choice not in (None, "none", "auto"):
            raise not_supported("tool_choice", "tool_choice 'required' or a named function (no "
                                               "constrained decoding)")
        ids, in_think = await asyncio.to_thread(_chat_prompt, srv, req)
        job = srv.job(req, "chat", ids, req.max_completion_tokens or req.max_tokens)
        job.in_think = in_think
        if req.tools and req.tool_choice != "none":
            job.tools = tool_schemas([t.model_dump(exclude_none=True) for t in req.tools])
        return await srv.run(request, job)

    return app
