"""/v1/messages' errors and isolation: Anthropic's error shape for invalid and unsupported
fields, unknown models and routes, bad keys, bodies over the size limit and a request the engine
fails on (a 500, or an `event: error` once streaming), while other routes keep OpenAI's; a client
that hangs up mid-stream aborts its engine request. The official `anthropic` client and plain
HTTP against a real uvicorn on loopback, on the bundled SmolLM2 (the session's `smollm2_engine`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from http.client import HTTPConnection
from urllib.parse import urlsplit

import anthropic
import pytest

from atom_engine.server.api_server import build_app
from atom_engine.testing import http, serve, wait_idle

MODEL = "smollm2-test"
KEY = "secret"
GREEDY = {"temperature": 0.0}
ASK = [{"role": "user", "content": "Name a color."}]
WEATHER = {
    "name": "get_weather",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture(scope="module")
def server(smollm2_engine):
    server = serve(build_app(smollm2_engine, MODEL, KEY), smollm2_engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


def post(server, path: str, body: dict | bytes, headers: dict | None = None):
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http("POST", f"{server.url}{path}", data, headers)


def _anthropic_error(response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


def test_api_keys(server, client):
    ok = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": ASK})
    assert ok.status_code == 200 and ok.json()["input_tokens"] > 0
    bearer = post(
        server,
        "/v1/messages/count_tokens",
        {"model": MODEL, "messages": ASK},
        {"x-api-key": "", "authorization": f"Bearer {KEY}"},
    )
    assert bearer.status_code == 200
    for headers in ({"x-api-key": "wrong"}, {"x-api-key": ""}):
        response = post(server, "/v1/messages", {"model": MODEL, "messages": ASK}, headers)
        _anthropic_error(response, 401, "authentication_error")
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=MODEL, messages=ASK, max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    # Other routes keep OpenAI's shape; x-api-key works there too.
    openai_401 = http("GET", server.url + "/v1/models", None, {"x-api-key": "wrong"})
    assert openai_401.status_code == 401 and openai_401.json()["error"]["code"] == 401
    models = http("GET", server.url + "/v1/models", None, {"x-api-key": KEY})
    assert models.status_code == 200


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": ASK}, "max_tokens"),  # required
        ({"max_tokens": 4, "messages": ASK, "container": "c"}, "container"),
        ({"max_tokens": 4, "messages": ASK, "mcp_servers": []}, "mcp_servers"),
        ({"max_tokens": 4, "messages": ASK, "service_tier": "auto"}, "service_tier"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "'image'",
        ),
        (
            {
                "max_tokens": 4,
                "messages": ASK,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            "tools.0.type",
        ),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, "role"),
        ({"max_tokens": 4, "messages": ASK, "stop_sequences": [""]}, "stop_sequences"),
        ({"max_tokens": 4, "messages": ASK, "top_p": 0}, "top_p"),
        ({"max_tokens": 4, "messages": ASK, "thinking": {"type": "enabled"}}, "reasoning parser"),
        ({"max_tokens": 4, "messages": ASK, "tools": [WEATHER]}, "--tool-call-parser"),
        (
            {
                "max_tokens": 4,
                "messages": ASK,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}],
            },
            "thinking block",
        ),
    ],
)
def test_unsupported_and_invalid_fields(server, body, named):
    message = _anthropic_error(post(server, "/v1/messages", {"model": MODEL, **body}), 400,
                               "invalid_request_error")  # fmt: skip
    assert named in message, message


def test_other_errors(server):
    missing = post(server, "/v1/messages", {"model": "nope", "max_tokens": 2, "messages": ASK})
    assert "nope" in _anthropic_error(missing, 404, "not_found_error")
    _anthropic_error(post(server, "/v1/messages/nothing", {}), 404, "not_found_error")
    bad_json = http("POST", server.url + "/v1/messages", b"{", {"x-api-key": KEY})
    assert "JSON" in _anthropic_error(bad_json, 400, "invalid_request_error")
    long = [{"role": "user", "content": "word " * 2000}]
    too_long = post(server, "/v1/messages", {"model": MODEL, "max_tokens": 2, "messages": long})
    _anthropic_error(too_long, 400, "invalid_request_error")
    wait_idle(server.engine)


def _aborted(server) -> float:
    registry = server.uvicorn.config.app.state.atom.metrics.registry
    labels = {"finished_reason": "abort"}
    return registry.get_sample_value("atom:request_success_total", labels) or 0.0


def test_disconnect_aborts(server):
    wait_idle(server.engine)
    before = _aborted(server)
    body = {"model": MODEL, "max_tokens": 900, "stream": True, **GREEDY, "messages": [
        {"role": "user", "content": "Count from 1 to 1000, one number a line."}]}  # fmt: skip
    connection = HTTPConnection(urlsplit(server.url).netloc, timeout=120)
    headers = {"content-type": "application/json", "x-api-key": KEY}
    connection.request("POST", "/v1/messages", json.dumps(body), headers)
    response = connection.getresponse()
    assert response.status == 200
    lines = [response.readline().decode() for _ in range(11)]  # up to the first delta
    assert lines[0] == "event: message_start\n" and lines[9] == "event: content_block_delta\n"
    connection.sock.shutdown(socket.SHUT_RDWR)  # hang up mid-stream
    connection.close()
    wait_idle(server.engine, timeout=30)  # aborted: no running request, KV blocks all free
    deadline = time.monotonic() + 10  # the handler counts the abort after the engine stops
    while _aborted(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == before + 1


def test_body_over_the_limit(smollm2_engine):
    small = serve(build_app(smollm2_engine, MODEL, max_request_body_bytes=1000), smollm2_engine)
    try:
        body = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "x" * 2000}],
        }
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            message = _anthropic_error(post(small, path, body), 413, "request_too_large")
            assert "1000 bytes" in message
        other = post(small, "/v1/chat/completions", body)
        assert other.status_code == 413 and other.json()["error"]["code"] == 413
    finally:
        small.stop()


def _fail_requests_of(llm_engine, max_tokens: int) -> None:
    """Make the engine fail (in post-processing, every step) the requests of `max_tokens`."""
    append = llm_engine.post.append_token

    def failing_append(seq, token_id, info):
        if seq.params.max_tokens == max_tokens:
            raise RuntimeError(f"injected fault of max_tokens {max_tokens}")
        append(seq, token_id, info)

    llm_engine.post.append_token = failing_append


def test_engine_failure(server, client):
    """A request the engine fails on ends alone: a 500 api_error, or an `event: error` once the
    stream began; the next request is served."""
    asyncio.run(server.engine.call(lambda e: _fail_requests_of(e, 7)))
    try:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 7}
        failed = post(server, "/v1/messages", body)
        streamed = post(server, "/v1/messages", {**body, "stream": True})
    finally:
        asyncio.run(server.engine.call(lambda e: e.post.__dict__.pop("append_token", None)))
    assert "injected fault" in _anthropic_error(failed, 500, "api_error")
    assert streamed.status_code == 200
    events = [chunk.split("\n") for chunk in streamed.text.strip().split("\n\n")]
    assert events[0][0] == "event: message_start" and events[-1][0] == "event: error"
    error = json.loads(events[-1][1].removeprefix("data: "))
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "injected fault" in error["error"]["message"]
    good = client.messages.create(model=MODEL, messages=ASK, max_tokens=2, extra_body=GREEDY)
    assert good.stop_reason == "max_tokens"
    assert server.engine.is_running
