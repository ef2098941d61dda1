"""The server's pieces without HTTP: incremental detokenising with stop strings, and the engine's worker with
adaptive K (greedy output must still equal plain decoding)."""

from __future__ import annotations

import asyncio
import time

import pytest

from spec.drafters import make_drafter
from spec.loop import generate
from spec.models import byte_tokenizer, load_pair
from spec.policy import parse_k
from spec.serving.engine import Delta, Done, Engine, Job
from spec.serving.text import TextStream
from spec.warps import Sampling


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def feed(stream: TextStream, ids: list[int]) -> list[tuple[str, bool]]:
    return [stream.push(i) for i in ids]


def test_deltas_never_split_a_character(tok):
    ids = tok("aé€b").input_ids
    assert len(ids) == 7  # one id per UTF-8 byte
    stream = TextStream(tok, [])
    deltas = [d for d, _ in feed(stream, ids)]
    assert deltas == ["a", "", "é", "", "", "€", "b"]
    assert stream.finish() == ("", False)


def test_stop_string_ends_text_before_it_and_holds_possible_prefixes(tok):
    stream = TextStream(tok, ["lo w", "zz"])
    steps = feed(stream, tok("hello world").input_ids[:7])  # "hello w"
    released = [d for d, _ in steps]
    assert "".join(released[:5]) == "hel"  # "lo" could start "lo w": held back, not sent
    assert [s for _, s in steps] == [False] * 6 + [True]
    assert "".join(released) == "hel"


def test_held_text_is_released_when_ruled_out_or_at_the_end(tok):
    stream = TextStream(tok, ["cd"])
    assert [d for d, _ in feed(stream, tok("abc").input_ids)] == ["a", "b", ""]
    assert stream.push(tok("x").input_ids[0]) == ("cx", False)
    stream.push(tok("c").input_ids[0])
    assert stream.finish() == ("c", False)


def test_earliest_stop_wins(tok):
    stream = TextStream(tok, ["world", "lo"])
    out = feed(stream, tok("hello world").input_ids)
    assert "".join(d for d, _ in out[: next(i for i, (_, s) in enumerate(out) if s) + 1]) == "hel"


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny")


def run_job(engine: Engine, prompt: list[int], max_tokens: int) -> tuple[str, Done]:
    async def go():
        job = Job(prompt=prompt, max_tokens=max_tokens, sampling=Sampling(), seed=None, stops=[], ignore_eos=False,
                  deadline=time.monotonic() + 120, loop=asyncio.get_running_loop())
        engine.submit(job)
        parts = []
        while True:
            event = await asyncio.wait_for(job.events.get(), 120)
            if isinstance(event, Delta):
                parts.append(event.text)
            else:
                return "".join(parts), event

    return asyncio.run(go())


def test_engine_with_adaptive_k_is_still_exact(pair):
    engine = Engine("draft", parse_k("auto"), queue_size=2, request_timeout=120)
    engine.start(pair)
    prompt = pair.tokenizer("The quick brown fox").input_ids
    text, done = run_job(engine, prompt, 24)
    plain = generate(pair.target, make_drafter("none", pair), prompt, 24, k=0, eos=pair.eos)
    assert isinstance(done, Done) and done.completion_tokens == len(plain.tokens)
    assert text == pair.tokenizer.decode(plain.tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert done.finish == plain.finish
