"""The OpenAI API's request and response shapes (with a few documented extensions), and its error envelope.

Requests are strict, as OpenAI's API is: a number is not a string and "5" is not a number. A parameter of OpenAI's
API that this server does not implement (tools, response_format, n > 1, ...) is refused with a 400 naming it, never
dropped in silence. Fields that are no part of OpenAI's API are ignored, as OpenAI ignores them; the extensions this
server reads are top_k, min_p, repetition_penalty, ignore_eos and coupled.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256
# OpenAI request parameters that change what is generated and that this server does not implement: a request that
# sets one gets a 400 naming it. (`user` and `metadata` change nothing generated and are accepted.)
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format",
               "audio", "modalities", "prediction", "web_search_options", "reasoning_effort", "store",
               "service_tier")


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
    min_p: float = Field(0.0, ge=0, le=1, allow_inf_nan=False,
                         description="drop tokens below min_p x the most likely one's probability; an extension")
    presence_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float = Field(1.0, gt=0, le=100, allow_inf_nan=False,
                                      description="transformers' and vLLM's repetition penalty (1 = off); an extension")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100]")
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    coupled: bool = Field(False, description="coupled sampling: with a seed, the same text with speculation on or "
                          "off (randomness keyed by seed and position); an extension")
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="generate past end-of-sequence ids (for benchmarks); an extension")
    user: str | None = None
    metadata: dict[str, str] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    store: Any = None
    service_tier: Any = None

    @field_validator(*UNSUPPORTED)
    @classmethod
    def _unimplemented(cls, value, info):
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, bias):
        for key, value in (bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (non-negative integers as strings), got {key!r}")
            if not -100 <= value <= 100:
                raise ValueError(f"biases must be in [-100, 100], got {value} for token {key}")
        return bias

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(key), value) for key, value in (self.logit_bias or {}).items()))

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
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self

    def logprob_count(self) -> int | None:
        """How many alternatives each token reports, or None for no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(Params):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="text or token ids; one prompt per request (a list of one is accepted)")
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: Any = None
    best_of: int | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value):
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value is not None:
            raise ValueError("suffix is not supported by this server")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best(cls, value):
        if value not in (None, 1):
            raise ValueError("this server returns one choice per request: best_of must be 1")
        return value

    def logprob_count(self) -> int | None:
        return self.logprobs


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    """Chat logprobs: each generated token's log-probability under the target's raw distribution (its logits
    before penalties, bias and temperature, as vLLM reports by default), with the most likely alternatives."""

    content: list[TokenLogprob]


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists per token, and a dict of alternatives per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatMessageOut
    finish_reason: Literal["stop", "length"]
    logprobs: ChatLogprobs | None = None


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
    logprobs: CompletionLogprobs | None = None


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
    draft_quant: str = "none"
    target_quant: str = "none"  # anything else: a changed model, answers exact against the quantized target only
    target_quant_report: dict | None = None  # its greedy agreement and KL against the unquantized target


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
