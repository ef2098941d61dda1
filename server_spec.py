"""An OpenAI-compatible server over the speculative loop.

    python server_spec.py --pair auto --method draft --k 4 --host 127.0.0.1 --port 8000 [--api-key KEY]

Endpoints: GET /v1/models, POST /v1/chat/completions, POST /v1/completions, GET /health (503 while the models load),
GET /metrics (Prometheus text, counters named like vLLM's under the `spark:` prefix).

No algorithm lives here: requests are validated, turned into token ids, and handed to one worker thread that drives
`spec.loop.speculate` (the models and their caches serve one stream at a time). The worker turns token ids into text
deltas and posts them to the request's asyncio queue; the request handler turns them into a JSON body or SSE chunks.
Waiting requests sit in a bounded queue (429 when full). A request whose client has gone, or whose time limit has
passed, is stopped between rounds. SIGTERM fails queued requests with 503 and gives the running one a grace period.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.exceptions import HTTPException

from spec import log
from spec.cli import add_model_args, load_from_args
from spec.common import Pair, resolve_pair
from spec.drafters import make_drafter
from spec.loop import speculate
from spec.policy import parse_k
from spec.rules import Sampling

logger = logging.getLogger("spark-spec.server")

MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256

# --------------------------------------------------------------------------------------------------------------
# Request and response shapes (the OpenAI API's, with a few documented extensions)
# --------------------------------------------------------------------------------------------------------------


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
             413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}

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


# --------------------------------------------------------------------------------------------------------------
# Token ids -> text
# --------------------------------------------------------------------------------------------------------------


class TextStream:
    """Turns generated token ids, one at a time, into text deltas.

    A delta never ends inside a UTF-8 character (a decoded window that ends in U+FFFD waits for the next token), and
    never contains text that a stop string may still claim: the longest tail that is a prefix of a stop string is
    held back until it is ruled out. When a stop string appears, the text before it is the last delta.
    Decoding works on a sliding window (the previous delta's tokens as context, then the new ones), not the whole text.
    """

    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = stops
        self.ids: list[int] = []
        self.prefix = self.read = 0  # window: ids[prefix:read] were decoded last time, ids[read:] are new
        self.text = ""  # all decoded text
        self.sent = 0  # characters of self.text already released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _advance(self, final: bool) -> None:
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def push(self, token: int) -> tuple[str, bool]:
        """Add one token; return (new text to release, whether a stop string was reached)."""
        self.ids.append(token)
        self._advance(final=False)
        return self._release(final=False)

    def finish(self) -> tuple[str, bool]:
        """Generation ended: release everything left (an incomplete character decodes as U+FFFD)."""
        self._advance(final=True)
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, bool]:
        # A stop string cannot start before `sent`: any such start would have been a held-back prefix.
        hits = [at for at in (self.text.find(s, self.sent) for s in self.stops) if at >= 0]
        if hits:
            delta = self.text[self.sent : min(hits)]
            self.sent = len(self.text)
            return delta, True
        keep = len(self.text)
        if not final:
            hold = max((n for s in self.stops for n in range(1, len(s)) if self.text.endswith(s[:n])), default=0)
            keep = max(self.sent, keep - hold)
        delta, self.sent = self.text[self.sent : keep], keep
        return delta, False


# --------------------------------------------------------------------------------------------------------------
# The engine: one worker thread, a bounded queue, metrics
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Done:
    finish: str
    prompt_tokens: int
    completion_tokens: int
    drafted: int
    accepted: int
    rounds: int


@dataclass
class Job:
    """One request on its way through the worker. Events (text deltas as str, then a Done or an ApiError) are posted
    from the worker thread to `events`, which belongs to the request's event loop."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stops: list[str]
    ignore_eos: bool
    deadline: float  # time.monotonic() after which the request fails with a timeout
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)  # set when the client has gone

    def post(self, event: str | Done | ApiError) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening any more
            pass


class Metrics:
    """Counters updated by the worker and rendered as Prometheus text. Names follow vLLM's (`vllm:spec_decode_...`)
    under our own prefix, so one scraper (bench.py) reads both servers."""

    PREFIX = "spark:"

    def __init__(self):
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.per_position: Counter = Counter()

    def add(self, name: str, value: int = 1) -> None:
        with self.lock:
            self.counts[name] += value

    def round(self, drafted: int, kept: int) -> None:
        with self.lock:
            if drafted:
                self.counts["spec_decode_num_drafts"] += 1
                self.counts["spec_decode_num_draft_tokens"] += drafted
                self.counts["spec_decode_num_accepted_tokens"] += kept
                for position in range(drafted):
                    self.per_position[position] += position < kept

    def render(self, gauges: dict[str, float]) -> str:
        with self.lock:
            counts, per_position = dict(self.counts), dict(self.per_position)
        lines = []
        for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
                     "prompt_tokens", "generation_tokens", "request_success", "request_cancelled",
                     "request_rejected", "request_timeout", "request_failure"):
            labelled = {key: value for key, value in counts.items() if key == name or key.startswith(name + "{")}
            lines.append(f"# TYPE {self.PREFIX}{name} counter")
            for key, value in sorted(labelled.items()) or [(name, 0)]:
                base, _, labels = key.partition("{")
                lines.append(f"{self.PREFIX}{base}_total{'{' + labels if labels else ''} {value}")
        lines.append(f"# TYPE {self.PREFIX}spec_decode_num_accepted_tokens_per_pos counter")
        for position, value in sorted(per_position.items()):
            lines.append(f'{self.PREFIX}spec_decode_num_accepted_tokens_per_pos_total{{position="{position}"}} {value}')
        for name, value in gauges.items():
            lines.append(f"# TYPE {name} gauge")
            lines.append(f"{name} {value}")
        return "\n".join(lines) + "\n"


def resident_bytes() -> int:
    """This process's resident memory (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Engine:
    """Owns the pair, the drafter and the one worker thread that generates.

    `submit` (event loop) puts a Job in the bounded queue or raises 429; the worker takes jobs one at a time and runs
    `speculate` for each, checking between rounds whether the client has gone, the deadline has passed, or a drain
    has run out of grace.
    """

    def __init__(self, method: str, k, queue_size: int, request_timeout: float):
        self.method = method
        self.k = k  # an int, or a factory of an adaptive KPolicy (spec.policy.parse_k)
        # One adaptive policy per decoding mode, kept across requests: its estimates of alpha and c stay valid from
        # one request to the next (same models, same machine), and greedy and sampling accept at different rates.
        self.policies: dict[bool, object] = {}
        self.request_timeout = request_timeout
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.metrics = Metrics()
        self.pair: Pair | None = None
        self.drafter = None
        self.running = 0
        self.draining = False
        self.drain_deadline = float("inf")
        self.thread: threading.Thread | None = None

    def k_for(self, sampling):
        """The K setting for one generation: the fixed K, or this decoding mode's long-lived adaptive policy."""
        if isinstance(self.k, int):
            return self.k
        if sampling.greedy not in self.policies:
            self.policies[sampling.greedy] = self.k()
        return self.policies[sampling.greedy]

    @property
    def ready(self) -> bool:
        return self.pair is not None

    def start(self, pair: Pair) -> None:
        self.pair = pair
        self.drafter = make_drafter(self.method, pair)
        self.thread = threading.Thread(target=self._work, name="spec-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.metrics.add('request_rejected{reason="queue_full"}')
            raise ApiError(429, f"the server is busy: {self.queue.maxsize} requests are already waiting; retry later",
                           code="queue_full") from None

    def drain(self, grace: float) -> None:
        """Stop taking work: queued jobs fail with 503, the running one may finish within `grace` seconds.
        Only sets flags, so that it is safe to call from a signal handler."""
        self.drain_deadline = time.monotonic() + grace
        self.draining = True

    def _fail_waiting(self) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            job.post(ApiError(503, "the server is shutting down", code="shutting_down"))

    def _work(self) -> None:
        while True:
            try:
                job = self.queue.get(timeout=0.1)
            except queue.Empty:
                continue
            if self.draining:
                job.post(ApiError(503, "the server is shutting down", code="shutting_down"))
                continue
            if job.cancel.is_set():
                self.metrics.add("request_cancelled")
                continue
            if time.monotonic() > job.deadline:
                self.metrics.add("request_timeout")
                job.post(ApiError(504, f"the request waited longer than the limit of {self.request_timeout:g} s",
                                  code="timeout"))
                continue
            self.running = 1
            try:
                self._generate(job)
            except Exception:  # a bug, not bad input: answer 500 and keep serving
                logger.exception("generation failed")
                self.metrics.add("request_failure")
                job.post(ApiError(500, "internal error during generation", code="internal_error"))
            finally:
                self.running = 0

    def _generate(self, job: Job) -> None:
        pair = self.pair
        generator = torch.Generator(device=pair.device)
        if job.seed is None:
            generator.seed()  # nondeterministic, from the OS
        else:
            generator.manual_seed(job.seed)
        text = TextStream(pair.tokenizer, job.stops)
        count = drafted = accepted = rounds_seen = 0
        finish = None
        rounds = speculate(pair.target, self.drafter, job.prompt, job.max_tokens,
                           k=self.k_for(job.sampling), sampling=job.sampling,
                           generator=generator, eos=() if job.ignore_eos else pair.eos,
                           timing=not isinstance(self.k, int))  # adaptive K learns from synced phase times
        try:
            for rnd in rounds:
                rounds_seen += 1
                drafted += rnd.drafted
                accepted += rnd.kept
                self.metrics.round(rnd.drafted, rnd.kept)
                # One delta per round, as the round's tokens arrive together (a chunk may carry several tokens).
                # Tokens go through the detokeniser one at a time so that a stop string ends the count exactly.
                deltas = []
                for token in rnd.tokens:
                    count += 1
                    delta, stopped = text.push(token)
                    deltas.append(delta)
                    if stopped:
                        finish = "stop"
                        break
                if rnd.finish and not finish:
                    delta, stopped = text.finish()
                    deltas.append(delta)
                    finish = "stop" if stopped else rnd.finish
                if "".join(deltas):
                    job.post("".join(deltas))
                if finish:
                    break
                if job.cancel.is_set():
                    self.metrics.add("request_cancelled")
                    return
                now = time.monotonic()
                if now > job.deadline:
                    self.metrics.add("request_timeout")
                    job.post(ApiError(504, f"generation ran past the limit of {self.request_timeout:g} s",
                                      code="timeout"))
                    return
                if self.draining:
                    self._fail_waiting()
                if self.draining and now > self.drain_deadline:
                    job.post(ApiError(503, "the server is shutting down; generation was aborted",
                                      code="shutting_down"))
                    return
        finally:
            rounds.close()
            self.metrics.add("generation_tokens", count)
        self.metrics.add("prompt_tokens", len(job.prompt))
        self.metrics.add(f'request_success{{finished_reason="{finish}"}}')
        job.post(Done(finish, len(job.prompt), count, drafted, accepted, rounds_seen))


# --------------------------------------------------------------------------------------------------------------
# The HTTP side
# --------------------------------------------------------------------------------------------------------------


class Gate:
    """ASGI middleware in front of everything: the API key (constant-time compare; /health stays public) and the
    request-body cap (read here, up to the cap, then replayed to the app), both answered in the OpenAI envelope."""

    def __init__(self, app, api_key: str | None, max_body: int):
        self.app = app
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if self.key and scope["path"] != "/health":
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.key):
                error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, send)
        if scope["method"] == "POST":
            kind = headers.get(b"content-type", b"application/json").split(b";")[0].strip().lower()
            if kind != b"application/json":
                error = ApiError(415, "send the body as JSON, with 'Content-Type: application/json'",
                                 code="unsupported_media_type")
                return await error.response()(scope, receive, send)
            if b"content-type" not in headers:  # a bare JSON body (no header) is read as JSON
                scope = {**scope, "headers": [*scope["headers"], (b"content-type", b"application/json")]}
        too_big = ApiError(413, f"the request body is larger than the limit of {self.max_body} bytes",
                           code="body_too_large")
        declared = headers.get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_body:
            return await too_big.response()(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            size += len(message.get("body", b""))
            if size > self.max_body:
                return await too_big.response()(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: waits for the client to disconnect

        await self.app(scope, replay, send)


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _events(job: Job, receive):
    """The job's events as they come; stops (and cancels the job) if the client disconnects first."""
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        while True:
            nxt = asyncio.ensure_future(job.events.get())
            await asyncio.wait({nxt, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():
                nxt.cancel()
                return
            event = nxt.result()
            yield event
            if not isinstance(event, str):
                return
    finally:
        gone.cancel()
        job.cancel.set()  # no-op if the job has ended; otherwise the worker stops at the next round


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 415, 429, 503, 504)}
STREAMING = {**ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                             "description": "JSON, or server-sent events when `stream` is true"}}


def create_app(engine: Engine, model_name: str, api_key: str | None = None, max_body: int = 1 << 20,
               max_model_len: int | None = None) -> FastAPI:
    """The FastAPI app behind the Gate. `max_model_len` caps prompt + max_tokens below the model's context."""
    app = FastAPI(title="spark-spec", version="0.1.0",
                  description="OpenAI-compatible speculative decoding: same answers, fewer target steps.")
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(request, err: ApiError):
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {"loc": (), "msg": "invalid request", "type": ""}
        if first.get("type") == "json_invalid":
            reason = (first.get("ctx") or {}).get("error", "")
            return ApiError(400, f"the body is not valid JSON: {reason}".rstrip(": "), code="invalid_json").response()
        # loc is ("body", field, index, ..., union member); the member names a type, not a place.
        loc = [str(part) for part in first.get("loc", ())[1:]]
        loc = [part for part in loc if part not in ("str", "int", "float", "bool") and "[" not in part]
        param = ".".join(loc) or None
        text = first["msg"].removeprefix("Value error, ")
        message = f"{param}: {text}" if param else f"the body must be a JSON object with the request's fields: {text}"
        return ApiError(400, message, param=param, code="invalid_value").response()

    @app.exception_handler(HTTPException)
    async def _http(request, err: HTTPException):
        return ApiError(err.status_code, str(err.detail), headers=err.headers).response()

    def context_length(pair: Pair) -> int:
        return min(pair.target.max_length, max_model_len or pair.target.max_length)

    def need_ready() -> Pair:
        if not engine.ready:
            raise ApiError(503, "the models are still loading; retry when GET /health answers 200", code="loading")
        return engine.pair

    def check_model(name: str) -> None:
        if name != model_name:
            shown = name if len(name) <= 100 else name[:100] + "…"
            raise ApiError(404, f"model {shown!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def make_job(prompt: list[int], req: Params, loop) -> Job:
        pair = need_ready()
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
        context = context_length(pair)
        room = context - len(prompt)
        wanted = req.max_completion_tokens or req.max_tokens
        if room < 1 or (wanted is not None and wanted > room):
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({wanted or 1}) exceeds the "
                           f"context of {context} tokens", param="max_tokens", code="context_length_exceeded")
        return Job(prompt=prompt, max_tokens=wanted or room,
                   sampling=Sampling(req.temperature, req.top_k, req.top_p), seed=req.seed, stops=req.stops(),
                   ignore_eos=req.ignore_eos, deadline=time.monotonic() + engine.request_timeout, loop=loop)

    async def respond(request: Request, req: Params, prompt: list[int], chat: bool):
        job = make_job(prompt, req, asyncio.get_running_loop())
        engine.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        now = int(time.time())
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(stream(job, request.receive, rid, now, chat, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        parts, done = [], None
        async with contextlib.aclosing(_events(job, request.receive)) as events:
            async for event in events:
                if isinstance(event, ApiError):
                    raise event
                if isinstance(event, Done):
                    done = event
                else:
                    parts.append(event)
        if done is None:  # the client has gone: nobody reads this answer
            return JSONResponse({}, status_code=499)
        text = "".join(parts)
        usage = Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                      total_tokens=done.prompt_tokens + done.completion_tokens)
        stats = SpecStats(method=engine.method, drafted=done.drafted, accepted=done.accepted, rounds=done.rounds)
        if chat:
            body = ChatCompletion(id=rid, created=now, model=model_name, usage=usage, speculation=stats,
                                  choices=[ChatChoice(message=ChatMessageOut(content=text), finish_reason=done.finish)])
        else:
            body = Completion(id=rid, created=now, model=model_name, usage=usage, speculation=stats,
                              choices=[CompletionChoice(text=text, finish_reason=done.finish)])
        return JSONResponse(body.model_dump())

    async def stream(job: Job, receive, rid: str, now: int, chat: bool, include_usage: bool):
        """SSE: the role first (chat), text deltas in order, one chunk with finish_reason, the usage chunk if asked,
        then [DONE]. An error becomes an error chunk, then [DONE]."""
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": now, "model": model_name}
        if include_usage:
            head["usage"] = None

        def chunk(text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
            return {**head, "choices": [choice]}

        if chat:
            yield _sse(chunk(role=True))
        async with contextlib.aclosing(_events(job, receive)) as events:
            async for event in events:
                if isinstance(event, ApiError):
                    yield _sse(event.body())
                elif isinstance(event, Done):
                    stats = SpecStats(method=engine.method, drafted=event.drafted, accepted=event.accepted,
                                      rounds=event.rounds)
                    yield _sse({**chunk(finish=event.finish), "speculation": stats.model_dump()})
                    if include_usage:
                        total = event.prompt_tokens + event.completion_tokens
                        usage = Usage(prompt_tokens=event.prompt_tokens, completion_tokens=event.completion_tokens,
                                      total_tokens=total)
                        yield _sse({**head, "choices": [], "usage": usage.model_dump()})
                else:
                    yield _sse(chunk(text=event))
        yield _sse("[DONE]")

    @app.get("/health", response_model=Health, responses={503: {"model": Health}})
    async def health():
        status = "draining" if engine.draining else "ok" if engine.ready else "loading"
        return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def models():
        pair = need_ready()
        k = "0" if engine.method == "none" else str(engine.k) if isinstance(engine.k, int) else "auto"
        served = ServedConfig(method=engine.method, k=k,
                              dtype=str(pair.dtype).removeprefix("torch."), device=str(pair.device))
        card = ModelCard(id=model_name, created=created, max_model_len=context_length(pair),
                         speculation=served)
        return ModelList(data=[card])

    @app.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMING)
    async def chat_completions(req: ChatRequest, request: Request):
        check_model(req.model)
        pair = need_ready()
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        try:
            rendered = pair.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own rules (e.g. role order) are the model's, not ours
            raise ApiError(400, f"the chat template rejected these messages: {err}", param="messages") from err
        prompt = pair.tokenizer(rendered, add_special_tokens=False).input_ids
        return await respond(request, req, prompt, chat=True)

    @app.post("/v1/completions", response_model=Completion, responses=STREAMING)
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        pair = need_ready()
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError(400, "one prompt per request: send a string, a list of token ids, or a list of one",
                               param="prompt", code="invalid_value")
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = pair.tokenizer(prompt).input_ids
        else:
            vocab = pair.target.vocab
            bad = next((i for i in prompt if not 0 <= i < vocab), None)
            if bad is not None:
                raise ApiError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="prompt",
                               code="invalid_value")
            ids = list(prompt)
        return await respond(request, req, ids, chat=False)

    @app.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)
    async def metrics():
        gauges = {"spark:num_requests_running": engine.running, "spark:num_requests_waiting": engine.queue.qsize(),
                  "process_resident_memory_bytes": resident_bytes()}
        return PlainTextResponse(engine.metrics.render(gauges), media_type="text/plain; version=0.0.4")

    def openapi() -> dict:
        # Invalid requests get 400 in the OpenAI envelope, never FastAPI's 422: say so in the schema too.
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            for path in schema["paths"].values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return Gate(app, api_key, max_body)


# --------------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------------


class Server(uvicorn.Server):
    """uvicorn's server, draining the engine when SIGTERM/SIGINT arrives (before uvicorn stops listening)."""

    def __init__(self, config, engine: Engine, grace: float):
        super().__init__(config)
        self.engine, self.grace = engine, grace

    def handle_exit(self, sig, frame) -> None:
        self.engine.drain(self.grace)
        super().handle_exit(sig, frame)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="OpenAI-compatible server over spark-spec's speculative loop (exact: the same answers as the "
                    "target alone). Binds to loopback by default.")
    add_model_args(parser)
    g = parser.add_argument_group("speculation")
    g.add_argument("--method", default="draft", choices=["draft", "lookup", "none"],
                   help="where drafts come from: the draft model, prompt lookup, or none (plain decoding)")
    g.add_argument("--k", default=4, type=parse_k, help="drafts per round: an integer, or auto / auto:MAX "
                   "(adaptive K, chosen each round from measured acceptance and costs)")
    g = parser.add_argument_group("serving")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback; 0.0.0.0 exposes it)")
    g.add_argument("--port", type=int, default=8000)
    keys = g.add_mutually_exclusive_group()
    keys.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* and /metrics")
    keys.add_argument("--api-key-file", help="the same, with the key read from a file (command lines are visible "
                                             "to every local user; files can be private)")
    g.add_argument("--served-model-name", help="the model name clients send (default: the pair's name)")
    g.add_argument("--queue", type=int, default=16, help="requests that may wait for the worker; more get 429")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take, waiting included, before it fails with 504")
    g.add_argument("--max-model-len", type=int, help="tokens a request may use, prompt + max_tokens "
                   "(default: the model's context)")
    g.add_argument("--max-body", type=int, default=1 << 20, help="largest request body in bytes (413 above)")
    g.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long the running request may continue before it is aborted")
    args = parser.parse_args(argv)
    if min(args.queue, args.max_body, args.max_model_len or 2) < 1 or args.request_timeout <= 0:
        parser.error("--queue, --request-timeout, --max-body and --max-model-len must be positive")
    if args.drain_seconds < 0:
        parser.error("--drain-seconds must be >= 0")
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                args.api_key = f.read().strip()
        except OSError as err:
            parser.error(f"cannot read --api-key-file: {err.strerror}")
        if not args.api_key:
            parser.error(f"--api-key-file {args.api_key_file} is empty")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    log.QUIET = args.quiet
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    engine = Engine(args.method, args.k, args.queue, args.request_timeout)
    model_name = args.served_model_name or args.target or resolve_pair(args.pair)[0]
    app = create_app(engine, model_name, args.api_key, args.max_body, args.max_model_len)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                            timeout_graceful_shutdown=args.drain_seconds + 5)
    server = Server(config, engine, args.drain_seconds)
    failed = []

    def load() -> None:
        # Models load while the server already answers /health with 503.
        try:
            engine.start(load_from_args(args, with_draft=args.method == "draft"))
        except SystemExit as err:  # load_from_args's clear message for a model that cannot be loaded
            failed.append(err)
            print(err.code, file=sys.stderr, flush=True)
            server.should_exit = True
            return
        log.info(f"ready: serving {model_name!r} on http://{args.host}:{args.port} "
                 f"(method {args.method}, K {args.k if isinstance(args.k, int) else 'auto'})")

    threading.Thread(target=load, name="load-models", daemon=True).start()
    server.run()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
