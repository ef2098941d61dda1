"""The engine: one worker thread that drives the speculative loop, a bounded queue in front of it, metrics.

Requests are validated and turned into token ids by the routes; the engine only generates. The models and their
caches serve one stream at a time, so one worker thread takes jobs from a bounded queue (429 when full) and runs
`spec.loop.speculate` for each. It turns token ids into text deltas and posts them to the request's asyncio queue.
A request whose client has gone, or whose time limit has passed, is stopped between rounds. A drain (SIGTERM) fails
queued requests with 503 and gives the running one a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from spec.drafters import make_drafter
from spec.loop import speculate
from spec.models import Pair
from spec.serving.metrics import Metrics
from spec.serving.schemas import ApiError
from spec.serving.text import TextStream, TokenSpeller
from spec.tree import most_nodes
from spec.warps import Sampling

logger = logging.getLogger("spark-spec.server")


@dataclass
class Done:
    """The end of a generation, with its counts."""

    finish: str
    prompt_tokens: int
    completion_tokens: int
    drafted: int
    accepted: int
    rounds: int


@dataclass
class TokenInfo:
    """One generated token's logprobs: its text, bytes and log-probability under the target's raw distribution,
    and the most likely alternatives as (text, bytes, log-probability)."""

    text: str
    bytes: list[int]
    logprob: float
    top: list[tuple[str, list[int], float]]


@dataclass
class Delta:
    """New text for the client, and the logprobs of the tokens it came from (None unless asked for)."""

    text: str
    logprobs: list[TokenInfo] | None = None


@dataclass
class Job:
    """One request on its way through the worker. Events (Deltas, then a Done or an ApiError) are posted from the
    worker thread to `events`, which belongs to the request's event loop."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    stops: list[str]
    ignore_eos: bool
    deadline: float  # time.monotonic() after which the request fails with a timeout
    loop: asyncio.AbstractEventLoop
    logprobs: int | None = None  # alternatives per token to report, or None for no logprobs
    arrived: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)  # set when the client has gone

    def post(self, event: Delta | Done | ApiError) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed (shutdown): nobody is listening any more
            pass


class Engine:
    """Owns the pair, the drafter and the one worker thread that generates.

    `submit` (event loop) puts a Job in the bounded queue or raises 429; the worker takes jobs one at a time and runs
    `speculate` for each, checking between rounds whether the client has gone, the deadline has passed, or a drain
    has run out of grace.
    """

    def __init__(self, method: str, k, queue_size: int, request_timeout: float, tree: tuple[int, ...] | None = None,
                 first_alone: bool = True):
        self.method = method
        self.first_alone = first_alone  # stream the first token after one plain step (spec.loop.speculate)
        self.tree = tree  # a token tree's branching per depth (spec/tree.py), or None for chains
        self.k = k  # an int, or a factory of an adaptive KPolicy (spec.policy.parse_k)
        # One adaptive policy per decoding mode, kept across requests: its estimates of alpha and c stay valid from
        # one request to the next (same models, same machine), and greedy and sampling accept at different rates.
        self.policies: dict[bool, object] = {}
        self.request_timeout = request_timeout
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self.metrics = Metrics(running=lambda: self.running, waiting=self.queue.qsize)
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

    def prepare(self, pair: Pair, context: int) -> None:
        """Before serving: ready the models for texts of up to `context` tokens (the graph backend captures its
        graphs and compiles its kernels), then generate a few tokens, so that the first request pays for none of
        it. Runs on the loading thread; the engine need not be started."""
        policy = None if isinstance(self.k, int) else self.k()
        max_k = 0 if self.method == "none" else self.k if policy is None else policy.max_k
        nodes = 0 if self.method == "none" else most_nodes(self.tree) or most_nodes(policy)
        pair.prepare(max_k, min(context, pair.target.max_length), nodes)
        prompt = pair.tokenizer("Hello").input_ids or [0]
        for _ in speculate(pair.target, make_drafter(self.method, pair, shape=self.tree), prompt, 4, k=max_k, eos=()):
            pass

    def start(self, pair: Pair) -> None:
        self.pair = pair
        self.speller = TokenSpeller(pair.tokenizer)
        self.drafter = make_drafter(self.method, pair, shape=self.tree)
        self.thread = threading.Thread(target=self._work, name="spec-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        if self.draining:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self.metrics.rejected.labels(reason="queue_full").inc()
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
                self.metrics.cancelled.inc()
                continue
            if time.monotonic() > job.deadline:
                self.metrics.timeout.inc()
                job.post(ApiError(504, f"the request waited longer than the limit of {self.request_timeout:g} s",
                                  code="timeout"))
                continue
            self.running = 1
            try:
                self._generate(job)
            except Exception:  # a bug, not bad input: answer 500 and keep serving
                logger.exception("generation failed")
                self.metrics.failure.inc()
                job.post(ApiError(500, "internal error during generation", code="internal_error"))
            finally:
                self.running = 0

    def _token_info(self, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenInfo:
        return TokenInfo(*self.speller(token), logprob, [(*self.speller(t), lp) for t, lp in top])

    def _generate(self, job: Job) -> None:
        pair = self.pair
        generator = torch.Generator(device=pair.device)
        if job.seed is None:
            seed = generator.seed()  # nondeterministic, from the OS; also keys a coupled request's noise
        else:
            seed = job.seed
            generator.manual_seed(seed)
        text = TextStream(pair.tokenizer, job.stops)
        count = drafted = accepted = rounds_seen = 0
        finish = last_emit = None
        rounds = speculate(pair.target, self.drafter, job.prompt, job.max_tokens,
                           k=self.k_for(job.sampling), sampling=job.sampling,
                           generator=generator, eos=() if job.ignore_eos else pair.eos, seed=seed,
                           logprobs=job.logprobs, first_alone=self.first_alone,
                           timing=not isinstance(self.k, int))  # adaptive K learns from synced phase times
        try:
            for rnd in rounds:
                rounds_seen += 1
                drafted += rnd.drafted
                accepted += rnd.accepted
                self.metrics.round(rnd.drafted, rnd.accepted)
                now = time.monotonic()
                if last_emit is None:
                    self.metrics.ttft.observe(now - job.arrived)
                else:
                    for _ in rnd.tokens:
                        self.metrics.itl.observe((now - last_emit) / len(rnd.tokens))
                last_emit = now
                # One delta per round, as the round's tokens arrive together (a chunk may carry several tokens).
                # Tokens go through the detokeniser one at a time so that a stop string ends the count exactly.
                deltas, infos = [], None if rnd.logprobs is None else []
                for i, token in enumerate(rnd.tokens):
                    count += 1
                    delta, stopped = text.push(token)
                    deltas.append(delta)
                    if infos is not None:
                        infos.append(self._token_info(token, *rnd.logprobs[i]))
                    if stopped:
                        finish = "stop"
                        break
                if rnd.finish and not finish:
                    delta, stopped = text.finish()
                    deltas.append(delta)
                    finish = "stop" if stopped else rnd.finish
                if "".join(deltas) or infos:
                    job.post(Delta("".join(deltas), infos))
                if finish:
                    break
                if job.cancel.is_set():
                    self.metrics.cancelled.inc()
                    return
                if now > job.deadline:
                    self.metrics.timeout.inc()
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
            self.metrics.generation_tokens.inc(count)
        self.metrics.prompt_tokens.inc(len(job.prompt))
        self.metrics.success.labels(finished_reason=finish).inc()
        self.metrics.e2e.observe(time.monotonic() - job.arrived)
        self.metrics.acceptance_length.observe(count / max(rounds_seen, 1))
        job.post(Done(finish, len(job.prompt), count, drafted, accepted, rounds_seen))
