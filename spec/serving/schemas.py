"""The OpenAI API's request and response shapes (with a few documented extensions), and its error envelope.

Requests are strict, as OpenAI's API is: a number is not a string and "5" is not a number. Unknown fields are
ignored, as OpenAI ignores them.
"""

from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256


class Strict(BaseModel):
    # strict: a number is not a string and "5" is not a number, as in OpenAI's API; unknown fields are ignored.
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: str


class Message(Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class Params(Strict):
    """What both endpoints accept besides the prompt. `top_k` and `ignore_eos` are extensions (as in vLLM)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=0, description="keep the k most likely tokens (0 = off); an extension")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="generate past end-of-sequence ids (for benchmarks); an extension")

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("this server returns one choice per request: n must be 1")
        return n

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        for s in stops:
            if not s or len(s) > MAX_STOP_CHARS:
                raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        return stop

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Params):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool) -> bool:
        if logprobs:
            raise ValueError("logprobs are not supported by this server")
        return logprobs


class CompletionRequest(Params):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids; one prompt per request (a list of one is accepted)")
    echo: bool = False
    logprobs: int | None = None

    @field_validator("echo", "logprobs")
    @classmethod
    def _unsupported(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class SpecStats(BaseModel):
    """Extension: what speculation did for this request."""

    method: str
    drafted: int
    accepted: int
    rounds: int


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    speculation: SpecStats


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    speculation: SpecStats


class ServedConfig(BaseModel):
    """Extension: how this server speculates, so that a benchmark can label its rows."""

    method: str
    k: str
    dtype: str
    device: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "spark-spec"
    max_model_len: int
    speculation: ServedConfig


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "loading", "draining"]


class ApiError(Exception):
    """An error answered in the OpenAI envelope."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
             503: "service_unavailable", 504: "timeout"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Allow on a 405

    def body(self) -> dict:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)
