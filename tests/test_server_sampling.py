"""The full sampling surface through the official `openai` client: penalties, logit_bias, min_p, logprobs and the
coupled mode, each equal to what the loop itself does for the same request."""

import pytest
from test_server import ServerProcess, decode

from spec.drafters import NoDrafter, make_drafter
from spec.loop import generate
from spec.models import load_pair
from spec.warps import Sampling

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--method", "draft", "--k", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pair():
    return load_pair("tiny")


def complete(server, **fields):
    extra = {key: fields.pop(key) for key in ("min_p", "repetition_penalty", "top_k", "coupled") if key in fields}
    fields.setdefault("max_tokens", 16)
    return server.client().completions.create(model="tiny", prompt=PROMPT, extra_body={"ignore_eos": True, **extra},
                                              **fields)


def test_greedy_with_penalties_and_bias_equals_the_loops_plain_decoding(server, pair):
    """Penalties and bias change greedy text; speculation in the server still gives plain decoding's."""
    sampling = Sampling(presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
                        logit_bias=((ord("e"), 3.0), (ord(" "), -2.0)))
    ids = pair.tokenizer(PROMPT).input_ids
    plain = generate(pair.target, NoDrafter(), ids, 16, k=0, sampling=sampling).tokens
    assert plain != generate(pair.target, NoDrafter(), ids, 16, k=0).tokens  # the warps matter here
    answer = complete(server, temperature=0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
                      logit_bias={str(ord("e")): 3.0, str(ord(" ")): -2.0})
    assert answer.choices[0].text == decode(pair, plain)
    assert answer.model_extra["speculation"]["drafted"] > 0


def test_seeded_sampling_with_every_warp_repeats(server):
    fields = dict(temperature=0.9, top_p=0.9, seed=11, presence_penalty=0.5, frequency_penalty=0.3,
                  logit_bias={"101": 2.0}, min_p=0.05, repetition_penalty=1.1, top_k=40)
    assert complete(server, **fields).choices[0].text == complete(server, **fields).choices[0].text


def test_coupled_sampling_equals_the_loops_plain_coupled_decoding(server, pair):
    """With coupled: true and a seed, the server's speculative text is what plain decoding draws for that seed."""
    ids = pair.tokenizer(PROMPT).input_ids
    for seed in (3, 4):
        plain = generate(pair.target, NoDrafter(), ids, 16, k=0, sampling=Sampling(1.0, top_p=0.95, coupled=True),
                         seed=seed).tokens
        answer = complete(server, temperature=1.0, top_p=0.95, seed=seed, coupled=True)
        assert answer.choices[0].text == decode(pair, plain)


def test_chat_logprobs_are_the_targets_raw_logprobs(server, pair):
    answer = server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 12
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == answer.choices[0].message.content
    prompt = pair.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                                add_generation_prompt=True)
    ids = pair.tokenizer(prompt, add_special_tokens=False).input_ids
    plain = generate(pair.target, make_drafter("none", pair), ids, 12, k=0, logprobs=3)
    expected = [lp for r in plain.rounds for lp in r.logprobs]
    for got, (logprob, top) in zip(content, expected):
        # fp32: a verify's and a step's logits differ by <= 1e-3 (test_graph's bound), log_softmax by twice that
        assert abs(got.logprob - logprob) <= 2e-3 and len(got.top_logprobs) == 3
        assert [pair.tokenizer.decode([t]) for t, _ in top] == [alt.token for alt in got.top_logprobs]
        assert got.top_logprobs[0].logprob >= got.logprob - 2e-3  # greedy: the token is the most likely


def test_streamed_and_completion_logprobs(server):
    chunks = list(server.client().chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=10, temperature=0, logprobs=True,
        stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(streamed) == 10 and all(t.top_logprobs == [] for t in streamed)
    answer = complete(server, temperature=0, logprobs=2, max_tokens=10)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    # The legacy shape keys alternatives by their text, so two byte tokens that both print as U+FFFD share a key.
    assert all(1 <= len(alts) <= 2 for alts in lp.top_logprobs) and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
