"""The HTTP API's shapes: OpenAI-shaped errors and the request models with their field validation.

Errors are `{"error": {"message", "type", "param", "code"}}`. The models check what the OpenAI API
itself defines (types, `temperature` 0..2, `top_p` in (0, 1], `n`, `max_tokens` >= 1, penalties), so a
client learns the offending `param`. The limits that belong to the model and the engine (prompt ids
inside the vocabulary, `top_k`, the int64 seed, a non-empty prompt) are not repeated here: the engine's
`submit` validates them and the server turns its ValueError into a 400 with the engine's message.
"""
from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError


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


def internal_error(what: str) -> ApiError:
    """A bug in one request (500): the engine and the server keep running."""
    return ApiError(500, what, type_="server_error", code="internal_error")


def validation_error(e: ValidationError) -> ApiError:
    err = e.errors(include_url=False, include_input=False)[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    if err.get("type") == "json_invalid":
        return ApiError(400, f"request body is not valid JSON: {err.get('msg')}", code="invalid_json")
    where = f"'{loc}': " if loc else ""
    return ApiError(400, f"{where}{err.get('msg')}", param=loc or None, code="invalid_value")


def not_supported(param: str, what: str | None = None) -> ApiError:
    return ApiError(400, f"{what or param} is not supported by this server", param=param, code="not_supported")


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


class SamplingRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = 0                                      # extension; -1 and 0 both mean "all" (engine_top_k)
    seed: int | None = None                             # the engine checks that it fits in int64
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
            raise not_supported("logprobs")
        if self.presence_penalty or self.frequency_penalty:
            raise not_supported("presence_penalty" if self.presence_penalty else "frequency_penalty",
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

    def engine_top_k(self) -> int:
        """The API's top_k -> the engine's: -1 (vLLM's "all") is the engine's 0; the engine checks the rest."""
        return 0 if self.top_k == -1 else self.top_k


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatRequest(SamplingRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension (e.g. enable_thinking)
    add_generation_prompt: bool = True
    response_format: dict[str, Any] | None = None       # only {"type": "text"}: no structured output yet

    def check_unsupported(self):
        super().check_unsupported()
        if self.response_format is not None and self.response_format != {"type": "text"}:
            kind = self.response_format.get("type")
            raise not_supported("response_format", f"response_format {kind!r} (only {{'type': 'text'}}: this "
                                                   f"server has no structured output)")
