"""The HTTP endpoints, at module level on one router; the engine and the served configuration come from
`app.state.served` (set by `spec.serving.app.create_app`).

    GET /health   GET /v1/models   POST /v1/chat/completions   POST /v1/completions   GET /metrics
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from spec.models import Pair, chat_ids, dtype_name
from spec.serving.engine import Delta, Done, Engine, Job, TokenInfo
from spec.serving.schemas import (
    ApiError,
    ChatChoice,
    ChatCompletion,
    ChatLogprobs,
    ChatMessageOut,
    ChatRequest,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ErrorResponse,
    Health,
    ModelCard,
    ModelList,
    Params,
    ServedConfig,
    SpecStats,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from spec.warps import Sampling

ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 415, 429, 503, 504)}
STREAMING = {**ERRORS, 200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
                             "description": "JSON, or server-sent events when `stream` is true"}}

router = APIRouter()


@dataclass
class Served:
    """What the routes need: the engine, the name clients send, the context cap, when the server started."""

    engine: Engine
    model_name: str
    max_model_len: int | None = None
    created: int = 0

    def context_length(self, pair: Pair) -> int:
        return min(pair.target.max_length, self.max_model_len or pair.target.max_length)

    def ready_pair(self) -> Pair:
        if not self.engine.ready:
            raise ApiError(503, "the models are still loading; retry when GET /health answers 200", code="loading")
        return self.engine.pair

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            shown = name if len(name) <= 100 else name[:100] + "…"
            raise ApiError(404, f"model {shown!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")


def served(request: Request) -> Served:
    return request.app.state.served


class Answer:
    """One response, built the same way for a JSON body and for SSE chunks: the envelope, the choice, the usage and
    the speculation extension."""

    def __init__(self, s: Served, chat: bool):
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = s.model_name
        self.method = s.engine.method
        self.offset = 0  # characters of completion text before the next token (completions' text_offset)

    def stats(self, done: Done) -> SpecStats:
        return SpecStats(method=self.method, drafted=done.drafted, accepted=done.accepted, rounds=done.rounds)

    @staticmethod
    def usage(done: Done) -> Usage:
        return Usage(prompt_tokens=done.prompt_tokens, completion_tokens=done.completion_tokens,
                     total_tokens=done.prompt_tokens + done.completion_tokens)

    def logprobs(self, infos: list[TokenInfo] | None) -> ChatLogprobs | CompletionLogprobs | None:
        """The tokens' logprobs in the endpoint's shape (None when not asked for)."""
        if infos is None:
            return None
        if self.chat:
            return ChatLogprobs(content=[
                TokenLogprob(token=i.text, logprob=i.logprob, bytes=i.bytes,
                             top_logprobs=[TopLogprob(token=t, logprob=lp, bytes=b) for t, b, lp in i.top])
                for i in infos])
        offsets = []
        for info in infos:
            offsets.append(self.offset)
            self.offset += len(info.text)
        return CompletionLogprobs(tokens=[i.text for i in infos], token_logprobs=[i.logprob for i in infos],
                                  top_logprobs=[{t: lp for t, _, lp in i.top} for i in infos], text_offset=offsets)

    def body(self, text: str, done: Done, infos: list[TokenInfo] | None = None) -> dict:
        common = dict(id=self.id, created=self.created, model=self.model, usage=self.usage(done),
                      speculation=self.stats(done))
        logprobs = self.logprobs(infos)
        if self.chat:
            choice = ChatChoice(message=ChatMessageOut(content=text), finish_reason=done.finish, logprobs=logprobs)
            return ChatCompletion(choices=[choice], **common).model_dump()
        choice = CompletionChoice(text=text, finish_reason=done.finish, logprobs=logprobs)
        return Completion(choices=[choice], **common).model_dump()

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False,
              usage: bool = False, infos: list[TokenInfo] | None = None) -> dict:
        """A streamed chunk; `usage` = the stream asked for usage, so every chunk carries the field (null)."""
        logprobs = self.logprobs(infos)
        logprobs = None if logprobs is None else logprobs.model_dump()
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": logprobs}
        head = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice]}
        return {**head, "usage": None} if usage else head

    def final_chunks(self, done: Done, usage: bool) -> list[dict]:
        """The chunk with finish_reason (and the speculation extension), then the usage chunk if asked for."""
        chunks = [{**self.chunk(finish=done.finish, usage=usage), "speculation": self.stats(done).model_dump()}]
        if usage:
            chunks.append({**self.chunk(usage=True), "choices": [], "usage": self.usage(done).model_dump()})
        return chunks


def make_job(s: Served, prompt: list[int], req: Params) -> Job:
    pair = s.ready_pair()
    if not prompt:
        raise ApiError(400, "the prompt is empty", param="prompt", code="invalid_value")
    context = s.context_length(pair)
    room = context - len(prompt)
    wanted = req.max_completion_tokens or req.max_tokens
    if room < 1 or (wanted is not None and wanted > room):
        raise ApiError(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({wanted or 1}) exceeds the "
                       f"context of {context} tokens", param="max_tokens", code="context_length_exceeded")
    bias = req.bias()
    if bias and bias[-1][0] >= pair.target.vocab:
        raise ApiError(400, f"logit_bias: token id {bias[-1][0]} is outside the vocabulary "
                       f"(0..{pair.target.vocab - 1})", param="logit_bias", code="invalid_value")
    sampling = Sampling(req.temperature, req.top_k, req.top_p, min_p=req.min_p, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                        logit_bias=bias, coupled=req.coupled)
    return Job(prompt=prompt, max_tokens=wanted or room, sampling=sampling, seed=req.seed, stops=req.stops(),
               ignore_eos=req.ignore_eos, deadline=time.monotonic() + s.engine.request_timeout,
               loop=asyncio.get_running_loop(), logprobs=req.logprob_count())


async def respond(request: Request, s: Served, req: Params, prompt: list[int], chat: bool):
    job = make_job(s, prompt, req)
    s.engine.submit(job)
    answer = Answer(s, chat)
    if req.stream:
        usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(stream(job, request.receive, answer, usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    parts, infos, done = [], None if job.logprobs is None else [], None
    async with contextlib.aclosing(events_of(job, request.receive)) as events:
        async for event in events:
            if isinstance(event, ApiError):
                raise event
            if isinstance(event, Done):
                done = event
            else:
                parts.append(event.text)
                if infos is not None:
                    infos.extend(event.logprobs or [])
    if done is None:  # the client has gone: nobody reads this answer
        return JSONResponse({}, status_code=499)
    return JSONResponse(answer.body("".join(parts), done, infos))


async def stream(job: Job, receive, answer: Answer, usage: bool):
    """SSE: the role first (chat), text deltas in order, one chunk with finish_reason, the usage chunk if asked,
    then [DONE]. An error becomes an error chunk, then [DONE]."""
    if answer.chat:
        yield sse(answer.chunk(role=True, usage=usage))
    async with contextlib.aclosing(events_of(job, receive)) as events:
        async for event in events:
            if isinstance(event, ApiError):
                yield sse(event.body())
            elif isinstance(event, Done):
                for chunk in answer.final_chunks(event, usage):
                    yield sse(chunk)
            else:
                yield sse(answer.chunk(text=event.text, usage=usage, infos=event.logprobs))
    yield sse("[DONE]")


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def events_of(job: Job, receive):
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
            if not isinstance(event, Delta):
                return
    finally:
        gone.cancel()
        job.cancel.set()  # no-op if the job has ended; otherwise the worker stops at the next round


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
async def health(s: Served = Depends(served)):
    status = "draining" if s.engine.draining else "ok" if s.engine.ready else "loading"
    return JSONResponse({"status": status}, status_code=200 if status == "ok" else 503)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
async def models(s: Served = Depends(served)):
    pair = s.ready_pair()
    engine = s.engine
    k = "0" if engine.method == "none" else str(engine.k) if isinstance(engine.k, int) else "auto"
    config = ServedConfig(method=engine.method, k=k, dtype=dtype_name(pair.dtype), device=str(pair.device),
                          draft_quant=pair.draft_quant, target_quant=pair.target_quant,
                          target_quant_report=pair.target_report)
    return ModelList(data=[ModelCard(id=s.model_name, created=s.created, max_model_len=s.context_length(pair),
                                     speculation=config)])


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=STREAMING)
async def chat_completions(req: ChatRequest, request: Request, s: Served = Depends(served)):
    s.check_model(req.model)
    pair = s.ready_pair()
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
    try:
        prompt = chat_ids(pair.tokenizer, messages)
    except Exception as err:  # the template's own rules (e.g. role order) are the model's, not ours
        raise ApiError(400, f"the chat template rejected these messages: {err}", param="messages") from err
    return await respond(request, s, req, prompt, chat=True)


@router.post("/v1/completions", response_model=Completion, responses=STREAMING)
async def completions(req: CompletionRequest, request: Request, s: Served = Depends(served)):
    s.check_model(req.model)
    pair = s.ready_pair()
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
    return await respond(request, s, req, ids, chat=False)


@router.get("/metrics", response_class=PlainTextResponse, responses=ERRORS)
async def metrics(s: Served = Depends(served)):
    body, content_type = s.engine.metrics.render()
    return Response(body, media_type=content_type)
