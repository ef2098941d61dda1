"""The server end to end: the real server_spec.py on a free loopback port with the tiny pair, driven by the official
`openai` client (raw httpx where the wire format itself is under test). Greedy answers through the server must equal
spec.loop.generate's and plain decoding's, token for token."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

from spec.drafters import make_drafter
from spec.loop import generate
from spec.models import load_pair

ROOT = Path(__file__).resolve().parent.parent
KEY = "test-key-0123456789"
LONG = 3000  # max_tokens of a request meant to occupy the worker (the tiny pair needs minutes for that many)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """server_spec.py in a subprocess with the tiny pair; its log goes to a file that tests may read."""

    def __init__(self, *args: str, key: str | None = KEY):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key = key
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        command = [sys.executable, str(ROOT / "server_spec.py"), "--pair", "tiny", "--port", str(self.port), *args]
        if key:
            command += ["--api-key", key]
        self.proc = subprocess.Popen(command, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                         filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        self.wait_ready()

    def wait_ready(self, limit: float = 240) -> None:
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"server not ready after {limit} s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key or "none", **kwargs)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", headers=self.headers(), timeout=10).text
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        Path(self.log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--method", "draft", "--k", "4", "--queue", "2")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny")


def sse_events(response: httpx.Response) -> list:
    """The data payloads of an SSE response, JSON-decoded except the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def envelope(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


MESSAGES = [{"role": "user", "content": "Write a haiku about caches."}]


def reference(pair, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens from the loop (draft model, K = 4), checked against plain decoding."""
    spec = generate(pair.target, make_drafter("draft", pair), prompt, max_tokens, k=4, eos=pair.eos)
    plain = generate(pair.target, make_drafter("none", pair), prompt, max_tokens, k=0, eos=pair.eos)
    assert spec.tokens == plain.tokens
    return spec.tokens


def decode(pair, tokens: list[int]) -> str:
    return pair.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def greedy_chat(server, pair):
    """One greedy chat answer through the server, with the loop's reference for the same prompt."""
    answer = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0)
    rendered = pair.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    prompt = pair.tokenizer(rendered, add_special_tokens=False).input_ids
    return answer, prompt, reference(pair, prompt, 24)


def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_greedy_chat_equals_loop_and_plain_decoding(greedy_chat, pair):
    answer, prompt, tokens = greedy_chat
    choice = answer.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == decode(pair, tokens)
    assert choice.finish_reason == ("stop" if tokens[-1] in pair.eos else "length")
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == len(tokens)
    assert answer.usage.total_tokens == len(prompt) + len(tokens)
    stats = answer.model_extra["speculation"]
    assert stats["method"] == "draft" and stats["drafted"] > 0 and 0 <= stats["accepted"] <= stats["drafted"]


def test_metrics_count_the_request_and_time_it(server, greedy_chat):
    """After a finished request the vLLM-style counters and the latency histograms have seen it."""
    answer = greedy_chat[0]
    m = server.metrics()
    assert m['spark:request_success_total{finished_reason="length"}'] + \
        m['spark:request_success_total{finished_reason="stop"}'] >= 1
    assert m["spark:generation_tokens_total"] >= answer.usage.completion_tokens
    assert m["spark:spec_decode_num_accepted_tokens_total"] <= m["spark:spec_decode_num_draft_tokens_total"]
    assert m['spark:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] <= m[
        "spark:spec_decode_num_drafts_total"]
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_acceptance_length"):
        assert m[f"spark:{name}_count"] >= 1, name
        assert m[f'spark:{name}_bucket{{le="+Inf"}}'] == m[f"spark:{name}_count"], name
    # Every token after the first round's (at most K + 1 = 5, timed as TTFT) gets an inter-token latency.
    assert m["spark:inter_token_latency_seconds_count"] >= answer.usage.completion_tokens - 5
    assert m["spark:request_acceptance_length_sum"] >= m["spark:request_acceptance_length_count"]  # >= 1 each
    assert m["process_resident_memory_bytes"] > 0
    assert m["spark:num_requests_running"] == 0 and m["spark:num_requests_waiting"] == 0


def test_streaming_equals_non_streaming(server, greedy_chat):
    answer = greedy_chat[0]
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1 and finished[0].choices[0].finish_reason == answer.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_the_first_token_comes_alone_and_the_rest_in_rounds(server):
    """--first-token alone (the default): the first chunk carries one token (a plain step after the prefill), where
    the first round of this prompt keeps all 4 drafts (with `--first-token with-round` its first chunk carries 5);
    later chunks carry whole rounds, several tokens at a time."""
    chunks = list(server.client().completions.create(
        model="tiny", prompt="Write a haiku about caches.", max_tokens=24, temperature=0, stream=True, logprobs=1,
        extra_body={"ignore_eos": True}))
    counts = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]
    assert counts[0] == 1 and counts[1] > 1 and sum(counts) == 24


def test_sse_wire_format(server):
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, headers=server.headers(),
                      timeout=120) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    assert all("usage" not in e for e in events[:-1])  # no usage chunk unless asked
    assert sum(e["choices"][0]["finish_reason"] is not None for e in events[:-1]) == 1
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_with_token_ids_equal_loop(server, pair):
    prompt = pair.tokenizer("def add(a, b):").input_ids
    answer = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
    tokens = reference(pair, prompt, 16)
    assert answer.choices[0].text == decode(pair, tokens)
    assert answer.usage.prompt_tokens == len(prompt) and answer.usage.completion_tokens == len(tokens)


def test_seeded_sampling_repeats(server):
    ask = lambda: server.client().completions.create(  # noqa: E731
        model="tiny", prompt="once upon", max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
        extra_body={"top_k": 50}).choices[0].text
    assert ask() == ask()


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text_before_it(server, greedy_chat, stream):
    full = greedy_chat[0].choices[0].message.content
    stop = full[6:8]
    assert len(stop) == 2
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, stop=[stop])
    if stream:
        chunks = list(server.client().chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        choice = server.client().chat.completions.create(**kwargs).choices[0]
        text, finish = choice.message.content, [choice.finish_reason]
    assert text == full[: full.find(stop)]
    assert finish == ["stop"]


@pytest.mark.parametrize("body, status, param", [
    ({"n": 2}, 400, "n"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"stop": 5}, 400, "stop"),
    ({"messages": []}, 400, "messages"),
    ({"model": "gpt-4o"}, 404, "model"),
    ({"max_tokens": 5000}, 400, "max_tokens"),  # prompt + max_tokens > the tiny context of 4096
])
def test_bad_requests_get_the_envelope(server, body, status, param):
    request = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=request, headers=server.headers(), timeout=30)
    assert response.status_code == status
    assert envelope(response)["param"] == param or envelope(response)["param"].startswith(param)


def test_malformed_json_is_400(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                          headers={**server.headers(), "Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 400
    envelope(response)


def test_api_key_required(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert response.status_code == 401 and envelope(response)["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert KEY not in server.logs()


def long_stream(server, client: httpx.Client, max_tokens: int = LONG):
    body = {"model": "tiny", "prompt": "x", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    return client.stream("POST", f"{server.url}/v1/completions", json=body, headers=server.headers())


def first_text(response: httpx.Response):
    """Read the stream until the first text arrives: the request is then running in the worker. Returns the line
    iterator, which the caller must hold while the request should keep running: once it is dropped, httpx closes
    the connection, and the server (rightly) cancels the request."""
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
            return lines
    raise AssertionError("the stream ended without text")


def test_disconnect_mid_stream_frees_the_worker(server):
    before = server.metrics()
    with httpx.Client(timeout=120) as client, long_stream(server, client) as response:
        first_text(response)
    # The client has gone; the next request must not wait for the 3000 tokens of the abandoned one.
    start = time.monotonic()
    answer = server.client(timeout=60).completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens == 4
    assert time.monotonic() - start < 60
    after = server.metrics()
    assert after["spark:request_cancelled_total"] == before["spark:request_cancelled_total"] + 1
    assert after["spark:generation_tokens_total"] - before["spark:generation_tokens_total"] < LONG


def test_disconnect_while_waiting_non_streaming(server):
    """A non-streamed request whose client leaves is cancelled too (here while it waits in the queue)."""
    before = server.metrics()
    with httpx.Client(timeout=120) as client, long_stream(server, client) as running:
        lines = first_text(running)  # noqa: F841 (held: the running request stays connected)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", headers=server.headers(), timeout=1.0,
                       json={"model": "tiny", "prompt": "y", "max_tokens": LONG, "ignore_eos": True})
    answer = server.client(timeout=60).completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2
    after = server.metrics()
    assert after["spark:request_cancelled_total"] == before["spark:request_cancelled_total"] + 2


def test_queue_full_is_429(server):
    with httpx.Client(timeout=120) as client:
        with long_stream(server, client) as running:
            lines = first_text(running)  # noqa: F841 (held: the worker stays busy with it; the queue holds 2)
            with long_stream(server, client) as waiting1, long_stream(server, client) as waiting2:
                assert waiting1.status_code == waiting2.status_code == 200
                with pytest.raises(openai.RateLimitError) as caught:
                    server.client(max_retries=0).completions.create(model="tiny", prompt="z", max_tokens=2)
                assert caught.value.status_code == 429
                assert caught.value.body["code"] == "queue_full"
    answer = server.client(timeout=60).completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason == "length"
