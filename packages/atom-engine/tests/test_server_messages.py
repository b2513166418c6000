"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the official
`anthropic` client against a real uvicorn on loopback, on the bundled SmolLM2 (the session's
`smollm2_engine`). Answers are checked against the chat completion of the same conversation;
errors on these routes have Anthropic's shape, those of the other routes stay OpenAI's.

Two apps share the engine: one with an API key, and one started with `--tool-call-parser hermes
--reasoning-parser deepseek_r1`. Requests keep max_tokens small.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from atom_engine.server.api_server import build_app
from atom_engine.testing import http, serve

MODEL = "smollm2-test"
KEY = "secret"
# The anthropic client (v2) has no sampling arguments: they go in the body as extras.
GREEDY = {"temperature": 0.0}
SYSTEM = "You are a terse assistant."
ASK = [{"role": "user", "content": "Name a color."}]
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}


@pytest.fixture(scope="module")
def server(smollm2_engine):
    server = serve(build_app(smollm2_engine, MODEL, KEY), smollm2_engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def parser_client(smollm2_engine):
    app = build_app(
        smollm2_engine, MODEL, tool_call_parser="hermes", reasoning_parser="deepseek_r1"
    )
    server = serve(app, smollm2_engine)
    yield anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    server.stop()


def post(server, path: str, body: dict, headers: dict | None = None):
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01", **(headers or {})}
    return http("POST", f"{server.url}{path}", json.dumps(body).encode(), headers)


def _anthropic_error(response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body["error"]) == {"type", "message"}
    return body["error"]["message"]


def test_text_equals_chat_completion(server, client):
    message = client.messages.create(
        model=MODEL, system=SYSTEM, messages=ASK, max_tokens=12, extra_body=GREEDY
    )
    chat = http(
        "POST",
        server.url + "/v1/chat/completions",
        json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "system", "content": SYSTEM}, *ASK],
                "max_tokens": 12,
                "temperature": 0.0,
            }
        ).encode(),
        {"authorization": f"Bearer {KEY}"},
    ).json()
    text = chat["choices"][0]["message"]["content"]
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == text
    assert message.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    finish = chat["choices"][0]["finish_reason"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    # System as text blocks, content as a block list: the same prompt.
    blocks = client.messages.create(
        model=MODEL,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}],
        max_tokens=12,
        extra_body=GREEDY,
        metadata={"user_id": "u1"},
    )
    assert blocks.content[0].text == text and blocks.usage == message.usage
    # count_tokens: the prompt the message call was charged for.
    counted = client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK)
    assert counted.input_tokens == message.usage.input_tokens


def _sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event; the name matches the data's type."""
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        event = (name.removeprefix("event: "), json.loads(data.removeprefix("data: ")))
        assert event[0] == event[1]["type"], chunk
        events.append(event)
    return events


def test_stream_events(server, client):
    kwargs = {"model": MODEL, "messages": ASK, "max_tokens": 10, "extra_body": GREEDY}
    message = client.messages.create(**kwargs)
    raw = post(server, "/v1/messages", {**kwargs.pop("extra_body"), **kwargs, "stream": True})
    assert raw.status_code == 200
    kinds = [name for name, _ in _sse_events(raw.text)]
    assert kinds[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert kinds[-4:] == ["content_block_delta", "content_block_stop", "message_delta",
                          "message_stop"]  # fmt: skip
    assert set(kinds[3:-3]) == {"content_block_delta"}
    with client.messages.stream(**kwargs, extra_body=GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    blocks = [e for e in events if e.type.startswith("content_block")]
    assert blocks[0].type == "content_block_start" and blocks[-1].type == "content_block_stop"
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == message.content[0].text == final.content[0].text
    assert final.stop_reason == message.stop_reason == "max_tokens"
    assert final.usage.output_tokens == message.usage.output_tokens == 10
    assert final.usage.input_tokens == message.usage.input_tokens


def test_stop_reasons(client):
    base = {"model": MODEL, "messages": ASK, "extra_body": GREEDY}
    cut = client.messages.create(**base, max_tokens=2)
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None
    assert cut.usage.output_tokens == 2
    text = client.messages.create(**base, max_tokens=12).content[0].text
    word = text.split()[1]  # the model's own second word
    stopped = client.messages.create(**base, max_tokens=12, stop_sequences=["zzz", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text and text.startswith(stopped.content[0].text)


def test_tool_use_round_trip(client):
    ask = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    base = {"model": MODEL, "messages": ask, "tools": [WEATHER], "max_tokens": 40,
            "extra_body": GREEDY}  # fmt: skip

    forced = client.messages.create(**base, tool_choice={"type": "tool", "name": "get_weather"})
    any_tool = {"type": "any", "disable_parallel_tool_use": True}
    with client.messages.stream(**base, tool_choice=any_tool) as stream:
        streamed = stream.get_final_message()
    assert forced.stop_reason == "tool_use"
    (call,) = [block for block in forced.content if block.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather"
    assert call.input["city"] in ("Paris", "London", "Tokyo") and "unit" in call.input
    assert streamed.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == ["tool_use"]
    assert streamed.content[0].name == "get_weather" and "city" in streamed.content[0].input
    # The call and its result go back; the model answers in text.
    history = [
        {"role": "user", "content": "What is the weather in Tokyo?"},
        {"role": "assistant", "content": forced.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"},
                {"type": "text", "text": "Thanks. Summarize."},
            ],
        },
    ]
    answer = client.messages.create(
        model=MODEL, messages=history, tools=[WEATHER], tool_choice={"type": "none"},
        max_tokens=6, extra_body=GREEDY,
    )  # fmt: skip
    assert answer.content[0].type == "text" and answer.stop_reason in ("max_tokens", "end_turn")
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=[WEATHER])
    assert counted.input_tokens == answer.usage.input_tokens


def test_thinking_and_parsed_tools(parser_client):
    # deepseek_r1: the reply is reasoning until </think> (SmolLM2 writes none: all of it).
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 12,
        "extra_body": GREEDY,
        "thinking": {"type": "enabled", "budget_tokens": 4},
    }
    message = parser_client.messages.create(**kwargs)
    # The budget: after 4 tokens `</think>` is forced, and the answer follows in a text block.
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert message.content[1].text and message.stop_reason == "max_tokens"
    free = parser_client.messages.create(**{**kwargs, "max_tokens": 4, "thinking": None})
    assert message.content[0].thinking == free.content[0].thinking  # the same first 4 tokens
    with parser_client.messages.stream(**kwargs) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == (
        message.content[0].thinking
    )
    assert "".join(d.text for d in deltas if d.type == "text_delta") == message.content[1].text
    adaptive = parser_client.messages.create(**{**kwargs, "thinking": {"type": "adaptive"}})
    assert [b.type for b in adaptive.content] == ["thinking"]  # no budget: SmolLM2 never closes
    # Thinking blocks of an assistant turn are accepted back; tools with the hermes parser.
    history = [
        *ASK,
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Pick one.", "signature": ""},
            {"type": "text", "text": "Blue."},
        ]},
        {"role": "user", "content": "Another?"},
    ]  # fmt: skip
    auto = parser_client.messages.create(
        model=MODEL, messages=history, tools=[WEATHER], max_tokens=4, extra_body=GREEDY,
        thinking={"type": "disabled"},
    )  # fmt: skip
    assert auto.stop_reason in ("max_tokens", "end_turn", "tool_use")
    with pytest.raises(anthropic.BadRequestError) as e:
        parser_client.messages.create(**{**kwargs, "thinking": {"type": "enabled"}})
    assert "budget_tokens" in e.value.body["error"]["message"]
    # A forced tool call takes no thinking (as Anthropic's API): a 400, not a failed request.
    with pytest.raises(anthropic.BadRequestError) as e:
        parser_client.messages.create(**kwargs, tools=[WEATHER], tool_choice={"type": "any"})
    assert "tool_choice" in e.value.body["error"]["message"]
