"""POST /tokenize and /detokenize (vLLM's): prompts and conversations to token ids, as a
completion or chat request would see them, and back; errors in the server's OpenAI shape."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from atom_engine.chat_template import apply_chat_template
from atom_engine.server.api_server import build_app
from atom_engine.server.protocol import DetokenizeRequest, TokenizeCompletionRequest
from atom_engine.server.serving_common import APIError, ServerState
from atom_engine.server.serving_tokenize import detokenize, tokenize
from atom_engine.testing import http, serve

MODEL = "smollm2-test"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(smollm2_engine):
    server = serve(build_app(smollm2_engine, MODEL, "secret"), smollm2_engine)
    yield server
    server.stop()


def call(server, path: str, body: dict, key: str | None = "secret"):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return http("POST", f"{server.url}{path}", json.dumps(body).encode(), headers)


def ok(server, path: str, body: dict) -> dict:
    response = call(server, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def test_tokenize_prompt(server):
    tokenizer = server.engine.tokenizer
    out = ok(server, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    assert out == {"count": len(ids), "max_model_len": 1024, "tokens": ids}
    # The ids a completion of the same prompt is charged for.
    usage = ok(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1})["usage"]
    assert usage["prompt_tokens"] == out["count"]
    bare = ok(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})
    assert bare["tokens"] == tokenizer.encode(PROMPT, add_special_tokens=False)
    strs = ok(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True})
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert len(strs["token_strs"]) == strs["count"]


def test_tokenize_messages(server):
    tokenizer = server.engine.tokenizer
    out = ok(server, "/tokenize", {"model": MODEL, "messages": CHAT})
    assert out["tokens"] == apply_chat_template(tokenizer, CHAT)
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] == 1024
    # Exactly the prompt a chat completion of the same messages runs on.
    chat = ok(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == out["count"]
    no_prompt = ok(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert no_prompt["count"] < out["count"]
    assert out["tokens"][: no_prompt["count"]] == no_prompt["tokens"]
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    custom = ok(server, "/tokenize", {"messages": CHAT, "chat_template": template})
    assert custom["tokens"] == tokenizer.encode("user: Name a color.\n", add_special_tokens=False)
    strs = ok(server, "/tokenize", {"messages": CHAT, "return_token_strs": True})
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(out["tokens"])


def test_detokenize_round_trip(server):
    tokens = ok(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False})["tokens"]
    assert ok(server, "/detokenize", {"model": MODEL, "tokens": tokens}) == {"prompt": PROMPT}
    assert ok(server, "/detokenize", {"tokens": []}) == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
        ("/tokenize", {"messages": CHAT, "echo": True}, 400, "echo"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"tools": []}}, 400, "messages"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": ["a"]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "skip": True}, 400, "skip"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ],
)
def test_errors(server, path, body, status, param):
    response = call(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status, error
    if param not in ("model", "messages"):
        assert param in error["message"], error


def test_api_key(server):
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        for key in (None, "wrong"):
            response = call(server, path, body, key)
            assert response.status_code == 401, response.text
            assert response.json()["error"]["code"] == 401


def test_no_tokenizer():
    engine = SimpleNamespace(tokenizer=None, max_model_len=8, engine=SimpleNamespace(vocab_size=8))
    state = ServerState(engine, MODEL, frozenset(), None, None)
    for coro in (
        tokenize(state, TokenizeCompletionRequest(prompt="x")),
        detokenize(state, DetokenizeRequest(tokens=[1])),
    ):
        with pytest.raises(APIError) as info:
            asyncio.run(coro)
        assert info.value.status == 400 and "tokenizer" in info.value.message
