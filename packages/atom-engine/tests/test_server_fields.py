"""Request fields the server honours beyond the OpenAI basics (vLLM's names): allowed_token_ids,
prompt_logprobs, chat_template, echo with max_tokens 0 (scoring), negative seeds."""

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


def post(server, endpoint: str, body: dict) -> dict:
    response = http("POST", f"{server.url}/v1/{endpoint}", json.dumps(body).encode())
    assert response.status_code == 200, response.text
    return response.json()


def test_allowed_token_ids(server):
    tokenizer = server.engine.tokenizer
    allowed = tokenizer.encode(" cat dog", add_special_tokens=False)
    for temperature in (0, 1.0):
        out = post(
            server,
            "completions",
            {
                "prompt": PROMPT,
                "max_tokens": 6,
                "temperature": temperature,
                "seed": 3,
                "allowed_token_ids": allowed,
                "ignore_eos": True,
            },
        )
        text = out["choices"][0]["text"]
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert set(ids) <= set(allowed) and out["usage"]["completion_tokens"] == 6, text


def test_prompt_logprobs(server):
    ids = server.engine.tokenizer.encode(PROMPT)
    out = post(server, "completions", {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2})
    prompt_logprobs = out["choices"][0]["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, entry in zip(ids[1:], prompt_logprobs[1:], strict=True):
        assert str(token_id) in entry  # the prompt's own token, with the top 2
        assert 2 <= len(entry) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in entry.values())
        assert {v["rank"] for v in entry.values()} >= {1, 2}
    chat = post(
        server,
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0},
    )
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) > 1
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_echo_with_max_tokens_zero_scores_the_prompt(server):
    ids = server.engine.tokenizer.encode(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}
    out = post(server, "completions", body)
    (choice,) = out["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 0,
        "total_tokens": len(ids),
    }
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) and logprobs["token_logprobs"][0] is None
    assert all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    # The prompt's log-probs are those of an ordinary echo with generation.
    full = post(server, "completions", {**body, "max_tokens": 2})
    assert (
        full["choices"][0]["logprobs"]["token_logprobs"][: len(ids)] == (logprobs["token_logprobs"])
    )
    # Streamed: one chunk with the prompt and its log-probs.
    stream = http(
        "POST",
        f"{server.url}/v1/completions",
        json.dumps({**body, "stream": True}).encode(),
    ).text
    events = [json.loads(e[6:]) for e in stream.splitlines() if e.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == PROMPT
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_template(server):
    messages = [{"role": "user", "content": "Say hi"}]
    default = post(server, "chat/completions", {"messages": messages, "max_tokens": 1})
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    custom = post(
        server,
        "chat/completions",
        {"messages": messages, "max_tokens": 1, "chat_template": template, "prompt_logprobs": 0},
    )
    ids = server.engine.tokenizer.encode("user: Say hi\n")
    assert custom["usage"]["prompt_tokens"] == len(ids)
    assert custom["usage"]["prompt_tokens"] != default["usage"]["prompt_tokens"]
    assert [int(next(iter(e))) for e in custom["prompt_logprobs"][1:]] == ids[1:]


def test_negative_seeds(server):
    def sample(seed):
        body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": seed, "n": 2}
        return [c["text"] for c in post(server, "completions", body)["choices"]]

    minus_one = sample(-1)
    assert minus_one == sample(-1)  # reproducible
    assert minus_one != sample(1)
    assert minus_one[0] != minus_one[1]
    assert sample(-(2**63))  # the whole int64 range is accepted
