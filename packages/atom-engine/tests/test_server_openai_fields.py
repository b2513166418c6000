"""OpenAI fields that clients send by default: accepted when ATOM already does what they ask
(store false, metadata, service_tier auto, modalities text, user, nulls), a 400 naming the field
when it asks for something ATOM does not do; reasoning_effort through chat templates that read
it."""

from __future__ import annotations

import json

import pytest

from atom_engine.server.api_server import build_app
from atom_engine.testing import http, serve

MODEL = "smollm2-test"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    server = serve(build_app(smollm2_engine, MODEL), smollm2_engine)
    yield server
    server.stop()


def call(server, endpoint: str, body: dict):
    return http("POST", f"{server.url}/v1/{endpoint}", json.dumps(body).encode())


def post(server, endpoint: str, body: dict) -> dict:
    response = call(server, endpoint, body)
    assert response.status_code == 200, response.text
    return response.json()


# What clients (the OpenAI SDKs, LangChain, ...) send, which ATOM already satisfies.
DEFAULTS = {
    "store": False,
    "metadata": {"team": "search"},
    "service_tier": "auto",
    "user": "u-1",
    "safety_identifier": "s-1",
    "prompt_cache_key": "k-1",
    "logit_bias": None,
    "n": None,
    "stream": None,
    "temperature": None,
    "ignore_eos": None,
    "min_tokens": None,
    "skip_special_tokens": None,
    "stream_options": None,
}
CHAT_DEFAULTS = {
    **DEFAULTS,
    "service_tier": "default",
    "modalities": ["text"],
    "functions": None,
    "function_call": None,
    "logprobs": None,
    "tools": None,
    "tool_choice": None,
    "reasoning_effort": None,
    "prediction": None,
    "add_generation_prompt": None,
}


def test_fields_clients_send_are_accepted(server):
    plain = post(server, "completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    sent = post(
        server, "completions", {"prompt": PROMPT, "max_tokens": 4, **DEFAULTS, "temperature": 0}
    )
    assert sent["choices"][0]["text"] == plain["choices"][0]["text"]
    chat = {"messages": CHAT, "max_tokens": 4, "temperature": 0}
    plain = post(server, "chat/completions", chat)
    sent = post(server, "chat/completions", {**CHAT_DEFAULTS, **chat, "functions": []})
    assert sent["choices"][0]["message"] == plain["choices"][0]["message"]
    assert len(sent["choices"]) == 1  # n null is the default 1


@pytest.mark.parametrize(
    ("endpoint", "extra", "param", "words"),
    [
        ("completions", {"store": True}, "store", "stores nothing"),
        ("chat/completions", {"store": True}, "store", "stores nothing"),
        ("chat/completions", {"service_tier": "flex"}, "service_tier", "auto"),
        ("completions", {"service_tier": "priority"}, "service_tier", "auto"),
        ("chat/completions", {"modalities": ["text", "audio"]}, "modalities", "text"),
        ("chat/completions", {"metadata": {"a": 1}}, "metadata", "string"),
        ("chat/completions", {"functions": [{"name": "f"}]}, "functions", "tools"),
        ("chat/completions", {"function_call": "auto"}, "function_call", "tools"),
        (
            "chat/completions",
            {"prediction": {"type": "content", "content": "x"}},
            "prediction",
            "not supported",
        ),
        ("chat/completions", {"reasoning_effort": "low"}, "reasoning_effort", "chat template"),
        ("chat/completions", {"reasoning_effort": "huge"}, "reasoning_effort", "low"),
        ("completions", {"reasoning_effort": "low"}, "reasoning_effort", "unknown"),
        ("completions", {"prompt": None}, "prompt", ""),
    ],
)
def test_fields_asking_for_what_atom_does_not_do_are_refused(server, endpoint, extra, param, words):
    base = {"prompt": PROMPT} if endpoint == "completions" else {"messages": CHAT}
    response = call(server, endpoint, {**base, "max_tokens": 2, **extra})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_reasoning_effort_reaches_templates_that_read_it(server):
    template = (
        "{{ reasoning_effort | default('none') }}|"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tokenizer = server.engine.tokenizer
    for effort in ("low", "high"):
        body = {
            "messages": CHAT,
            "max_tokens": 1,
            "chat_template": template,
            "reasoning_effort": effort,
            "prompt_logprobs": 0,
        }
        out = post(server, "chat/completions", body)
        ids = tokenizer.encode(f"{effort}|Say hi", add_special_tokens=False)
        assert [int(next(iter(e))) for e in out["prompt_logprobs"][1:]] == ids[1:]
    clash = {**body, "chat_template_kwargs": {"reasoning_effort": "low"}}
    response = call(server, "chat/completions", clash)
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"
