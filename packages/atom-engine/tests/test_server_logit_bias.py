"""logit_bias (OpenAI's: token-id keys, biases in [-100, 100]) on the bundled SmolLM2 through the
server: a +100 bias picks its token, a -100 bias bans the token an unbiased request produced,
with n > 1 and with a grammar; bad keys and values are 400s naming logit_bias."""

from __future__ import annotations

import json

import pytest

from atom_engine.server.api_server import build_app
from atom_engine.testing import http, serve

MODEL = "smollm2-test"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(smollm2_engine):
    server = serve(build_app(smollm2_engine, MODEL), smollm2_engine)
    yield server
    server.stop()


def call(server, endpoint: str, body: dict):
    return http("POST", f"{server.url}/v1/{endpoint}", json.dumps(body).encode())


def texts(server, endpoint: str, body: dict) -> list[str]:
    response = call(server, endpoint, body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    return [c["text"] if "text" in c else c["message"]["content"] for c in choices]


def one_token(server, text: str) -> int:
    (token_id,) = server.engine.tokenizer.encode(text, add_special_tokens=False)
    return token_id


@pytest.mark.parametrize("logprobs", [None, 1])  # the plain and the host-sampled path
def test_bias_picks_and_bans_tokens_greedy(server, logprobs):
    tokenizer = server.engine.tokenizer
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0, "logprobs": logprobs}
    (first,) = texts(server, "completions", body)
    banned = one_token(server, first)
    (other,) = texts(server, "completions", {**body, "logit_bias": {str(banned): -100}})
    assert other != first and other
    forced = one_token(server, " banana")
    assert forced != banned
    (text,) = texts(
        server,
        "completions",
        {**body, "max_tokens": 3, "ignore_eos": True, "logit_bias": {str(forced): 100}},
    )
    assert text == tokenizer.decode([forced] * 3)
    chat = {
        "messages": [{"role": "user", "content": "Say hi"}],
        "max_tokens": 2,
        "temperature": 0,
        "logit_bias": {str(forced): 100},
    }
    assert texts(server, "chat/completions", chat) == [tokenizer.decode([forced] * 2)]


def test_bias_with_n_samples(server):
    forced = one_token(server, " banana")
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 1.0, "seed": 1, "n": 3}
    biased = texts(server, "completions", {**body, "logit_bias": {str(forced): 100}})
    assert biased == [server.engine.tokenizer.decode([forced] * 2)] * 3
    # Ban whatever the unbiased samples start with: no biased sample starts with one of them.
    plain = texts(server, "completions", {**body, "max_tokens": 1, "n": 4})
    banned = {one_token(server, t) for t in plain}
    bias = {str(t): -100 for t in banned}
    again = texts(server, "completions", {**body, "max_tokens": 1, "n": 4, "logit_bias": bias})
    assert all(one_token(server, t) not in banned for t in again), (plain, again)


def test_bias_with_a_grammar(server):
    body = {
        "prompt": "Is Paris in France? Answer:",
        "max_tokens": 4,
        "temperature": 0,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    (plain,) = texts(server, "completions", body)
    assert plain in ("yes", "no")
    other = "no" if plain == "yes" else "yes"
    bias = {str(one_token(server, other)): 100}
    assert texts(server, "completions", {**body, "logit_bias": bias}) == [other]
    # A bias on a token the grammar forbids changes nothing.
    bias = {str(one_token(server, " banana")): 100}
    assert texts(server, "completions", {**body, "logit_bias": bias}) == [plain]


@pytest.mark.parametrize(
    "bias",
    [{"abc": 1}, {"-1": 1}, {"1.5": 1}, {"49152": 1}, {"5": 100.5}, {"5": -101}, {"5": "x"}],
)
def test_bad_bias_is_refused(server, bias):
    response = call(server, "completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": bias})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias", response.text
