"""The server's Prometheus metrics, one registry per app.

Names follow vLLM's (`vllm:spec_decode_num_drafts`, `vllm:time_to_first_token_seconds`, ...) under the `spark:`
prefix, so one scraper (bench.py) reads both servers:

- counters: spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens / _num_accepted_tokens_per_pos
  {position}, prompt_tokens, generation_tokens, request_success{finished_reason}, request_cancelled,
  request_rejected{reason}, request_timeout, request_failure;
- gauges: num_requests_running, num_requests_waiting, and the process collector's process_resident_memory_bytes;
- histograms per request: time_to_first_token_seconds (arrival to the first round's tokens), inter_token_latency_seconds
  (a round's gap since the previous one, per token it emitted: a round's tokens arrive together),
  e2e_request_latency_seconds, and request_acceptance_length (tokens per target forward, 1 + accepted / rounds:
  what speculation bought that request).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "spark:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                   80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0, 17.0)
FINISH_REASONS = ("stop", "length")
REJECT_REASONS = ("queue_full",)


class Metrics:
    """Counters and histograms the engine updates from its worker thread (prometheus_client is thread-safe)."""

    def __init__(self, running: Callable[[], float], waiting: Callable[[], float]):
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)

        def counter(name: str, about: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, about, labels, registry=self.registry)

        def histogram(name: str, about: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, about, buckets=buckets, registry=self.registry)

        self.drafts = counter("spec_decode_num_drafts", "rounds that drafted at least one token")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "drafted tokens")
        self.accepted_tokens = counter("spec_decode_num_accepted_tokens", "drafted tokens the rule accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "accepted tokens by their position in the round's drafts", ("position",))
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "generated tokens")
        self.success = counter("request_success", "finished requests", ("finished_reason",))
        self.cancelled = counter("request_cancelled", "requests whose client went away")
        self.rejected = counter("request_rejected", "requests refused before they ran", ("reason",))
        self.timeout = counter("request_timeout", "requests that ran past their time limit")
        self.failure = counter("request_failure", "requests that failed inside the server (500)")
        for reason in FINISH_REASONS:  # every series exists from the start, at 0
            self.success.labels(finished_reason=reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason=reason)
        Gauge(PREFIX + "num_requests_running", "requests generating now", registry=self.registry).set_function(running)
        Gauge(PREFIX + "num_requests_waiting", "requests in the queue", registry=self.registry).set_function(waiting)
        self.ttft = histogram("time_to_first_token_seconds", "arrival to the first generated text", LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "time per output token within a round", TOKEN_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "arrival to the last token", LATENCY_BUCKETS)
        self.acceptance_length = histogram("request_acceptance_length", "tokens per target forward of a request",
                                           LENGTH_BUCKETS)

    def round(self, drafted: int, accepted: int) -> None:
        """One round of the loop: `accepted` of its `drafted` tokens were accepted."""
        if drafted:
            self.drafts.inc()
            self.draft_tokens.inc(drafted)
            self.accepted_tokens.inc(accepted)
            for position in range(drafted):  # every drafted position has a series, accepted or not
                self.accepted_per_pos.labels(position=str(position)).inc(position < accepted)

    def render(self) -> tuple[bytes, str]:
        """(Prometheus text, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
