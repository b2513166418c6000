"""POST /v1/responses (OpenAI's Responses API) through `atom serve`: the official `openai` client
against a real uvicorn on loopback, on the bundled SmolLM2 (the session's `smollm2_engine`).

Two apps share the engine: a plain one, and one started with `--tool-call-parser hermes
--reasoning-parser deepseek_r1`, where a regex (vLLM's `structured_outputs`) has the model write
the markup a model trained on those formats would. Greedy answers are compared with the chat
completion of the same conversation.
"""

from __future__ import annotations

import json
import socket
from http.client import HTTPConnection
from urllib.parse import urlsplit

import jsonschema
import openai
import pytest

from atom_engine.server.api_server import build_app
from atom_engine.server.responses_api.objects import ResponseObject
from atom_engine.server.responses_api.store import ResponseStore, StoredResponse
from atom_engine.testing import http, serve, wait_idle

MODEL = "smollm2-test"
ASK = "Name a color."
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "pop": {"type": "integer", "minimum": 0, "maximum": 40},
    },
    "required": ["city", "pop"],
}
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["city"],
    },
}
TOOL_CALL = (
    r"[a-z]{1,6}\n</think>\n\n<tool_call>\n"
    r'\{"name": "get_weather", "arguments": \{"city": "(Paris|Tokyo)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(smollm2_engine):
    server = serve(build_app(smollm2_engine, MODEL, responses_store_size=8), smollm2_engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


@pytest.fixture(scope="module")
def parser_client(smollm2_engine):
    app = build_app(
        smollm2_engine, MODEL, tool_call_parser="hermes", reasoning_parser="deepseek_r1"
    )
    server = serve(app, smollm2_engine)
    yield server.client(timeout=300)
    server.stop()


def _chat(client, messages, max_tokens):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0
    )


def _streamed(client, **kwargs):
    """(the events, the final response) of a streamed response."""
    with client.responses.stream(**kwargs) as stream:
        return list(stream), stream.get_final_response()


def test_text_equals_the_chat_completion(client):
    # A list of message items: parts, a developer message (a system one to the template), an
    # assistant turn.
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": ASK}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"type": "message", "role": "user", "content": "Another one."},
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one."},
    ]
    response = client.responses.create(
        model=MODEL, input=ASK, instructions="Be brief.", max_output_tokens=12, temperature=0
    )
    chat = _chat(client, messages[:2], 12)
    listed = client.responses.create(
        model=MODEL, input=items, max_output_tokens=8, temperature=0, metadata={"k": "v"}
    )
    listed_chat = _chat(client, messages, 8)
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content
    message = response.output[0]
    assert message.type == "message" and message.id.startswith("msg_")
    assert message.content[0].type == "output_text"
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens
    assert usage.output_tokens == chat.usage.completion_tokens
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    finished = chat.choices[0].finish_reason
    assert response.status == ("incomplete" if finished == "length" else "completed")
    assert listed.output_text == listed_chat.choices[0].message.content
    assert listed.usage.input_tokens == listed_chat.usage.prompt_tokens
    assert listed.metadata == {"k": "v"} and listed.instructions is None


def test_max_output_tokens_is_incomplete(client):
    response = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, temperature=0)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2 and response.output[0].status == "incomplete"
    events = list(
        client.responses.create(
            model=MODEL, input=ASK, max_output_tokens=2, temperature=0, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == response.output_text


def test_stream_events_in_order(client):
    kwargs = dict(model=MODEL, input=ASK, max_output_tokens=24, temperature=0)
    kwargs["extra_body"] = {"stop": ["."]}  # ends the reply: response.completed
    whole = client.responses.create(**kwargs)
    events, final = _streamed(client, **kwargs)
    assert whole.status == "completed", whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    num_deltas = types.count("response.output_text.delta")
    assert num_deltas >= 2
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * num_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == final.output_text
    assert events[-4].text == text and events[-3].part.text == text
    assert (
        final.id == events[0].response.id and final.usage.output_tokens == whole.usage.output_tokens
    )
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def _tokens(server, messages) -> int:
    body = json.dumps({"messages": messages}).encode()
    return http("POST", server.url + "/tokenize", body).json()["count"]


def test_previous_response_id_and_store(server, client):
    first = client.responses.create(
        model=MODEL, input="My name is Ada.", max_output_tokens=6, temperature=0
    )
    conversation = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    second = client.responses.create(
        model=MODEL,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    chat = _chat(client, conversation, 6)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == _tokens(server, conversation)
    assert second.output_text == chat.choices[0].message.content
    # Stored: GET answers it; a missing id is a 404 naming it.
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id" and "resp_nope" in str(e.value)
    # store: false is not kept.
    unstored = client.responses.create(model=MODEL, input=ASK, max_output_tokens=2, store=False)
    assert unstored.store is False
    for call in (
        lambda: client.responses.retrieve(unstored.id),
        lambda: client.responses.create(model=MODEL, input="x", previous_response_id=unstored.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    # DELETE, then it is gone.
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_text_format(client):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    response = client.responses.create(
        model=MODEL,
        input="Describe Paris as JSON.",
        text={"format": fmt},
        max_output_tokens=40,
        temperature=0,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text.format.type == "json_schema"
    response = client.responses.create(
        model=MODEL,
        input="Describe Paris as JSON.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=0,
    )
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text), dict)


def test_tool_call_and_reasoning_round_trip(parser_client):
    # NOTE: requests one after the other: sent together (batched) this module's tests took 2-3x
    # longer on the shared 2-core CPU (eager; this test 68-107 s instead of 27-34 s).
    response = parser_client.responses.create(
        model=MODEL,
        input="What is the weather in Tokyo?",
        tools=[WEATHER],
        max_output_tokens=128,  # the forced markup takes ~70 tokens
        temperature=0,
        extra_body={"structured_outputs": {"regex": TOOL_CALL}},
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"] and response.status == "completed"
    reasoning, call = response.output
    assert reasoning.id.startswith("rs_")
    assert reasoning.content[0].text and "</think>" not in reasoning.content[0].text
    assert call.id.startswith("fc_") and call.call_id and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # The call's output fed back: the next turn's prompt holds the call and its result.
    feedback = [
        {"role": "user", "content": "What is the weather in Tokyo?"},
        *[item.model_dump(exclude_none=True) for item in response.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 22 C"},
    ]
    answer = parser_client.responses.create(
        model=MODEL,
        input=feedback,
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=4,
        temperature=0,
    )
    assert answer.usage.input_tokens > response.usage.input_tokens
    assert answer.output  # the reply (all reasoning to deepseek_r1 with no </think>)
    # Streamed reasoning, then text: reasoning events, then text events; the same items.
    regex = r"[a-z ]{1,12}\n</think>\n\nSunny\."
    kwargs = dict(model=MODEL, input="Weather?", max_output_tokens=32, temperature=0)
    kwargs["extra_body"] = {"structured_outputs": {"regex": regex}}
    whole = parser_client.responses.create(**kwargs)
    events, final = _streamed(parser_client, **kwargs)
    assert [i.type for i in whole.output] == ["reasoning", "message"]
    assert whole.output_text == final.output_text == "Sunny."
    assert final.output[0].content[0].text == whole.output[0].content[0].text
    types = [e.type for e in events]
    first_text = types.index("response.output_text.delta")
    assert "response.reasoning_text.delta" in types[:first_text]
    assert "response.reasoning_text.done" in types[:first_text]


def test_tool_choice_named_without_a_parser(client):
    kwargs = dict(
        model=MODEL,
        input="What is the weather in Tokyo?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=40,
        temperature=0,
    )
    response = client.responses.create(**kwargs)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # Streamed: the call's argument events, and the same call.
    events, final = _streamed(client, **kwargs)
    types = [e.type for e in events]
    assert types[2:-1] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert events[4].arguments == call.arguments == final.output[0].arguments
    assert final.output[0].name == "get_weather"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),  # SmolLM2's template ignores it
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"model": "gpt-5"}, "model"),
        ({"input": []}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ],
)
def test_unsupported_fields_are_400(server, extra, param):
    body = {"model": MODEL, "input": ASK, **extra}
    response = http("POST", server.url + "/v1/responses", json.dumps(body).encode())
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param, error


def test_disconnect_aborts(server):
    wait_idle(server.engine)
    body = {"model": MODEL, "input": ASK, "max_output_tokens": 500, "stream": True}
    body["ignore_eos"] = True
    connection = HTTPConnection(urlsplit(server.url).netloc, timeout=120)
    connection.request(
        "POST", "/v1/responses", json.dumps(body), {"content-type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    for _ in range(100):  # raw chunked lines: until the first text delta
        if b"response.output_text.delta" in response.fp.readline():
            break
    else:
        raise AssertionError("no text delta")
    connection.sock.shutdown(socket.SHUT_RDWR)  # hang up mid-stream
    connection.close()
    wait_idle(server.engine, timeout=30)  # aborted: no running request, KV blocks all free


def test_store_keeps_the_most_recently_used():
    store = ResponseStore(2)
    entries = [
        StoredResponse(ResponseObject(id=f"resp_{i}", status="completed", model=MODEL), [])
        for i in range(3)
    ]
    store.put(entries[0])
    store.put(entries[1])
    assert store.get("resp_0") is entries[0]  # now the most recent
    store.put(entries[2])
    assert store.get("resp_1") is None and len(store) == 2
    assert store.delete("resp_0") and not store.delete("resp_0")
    ResponseStore(0).put(entries[0])  # keeps none
    with pytest.raises(ValueError, match="store size"):
        ResponseStore(-1)


def test_engine_failure_ends_the_stream_failed(server, client):
    """A request the engine fails on once streaming: an `error` event, then `response.failed`
    (status failed, the error in the response); the next request is served."""
    import asyncio

    def fail_requests_of_7(llm_engine) -> None:
        append = llm_engine.post.append_token

        def failing_append(seq, token_id, info):
            if seq.params.max_tokens == 7:
                raise RuntimeError("injected fault")
            append(seq, token_id, info)

        llm_engine.post.append_token = failing_append

    asyncio.run(server.engine.call(fail_requests_of_7))
    try:
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 7, "stream": True}
        streamed = http("POST", f"{server.url}/v1/responses", json.dumps(body).encode())
    finally:
        asyncio.run(server.engine.call(lambda e: e.post.__dict__.pop("append_token", None)))
    assert streamed.status_code == 200, streamed.text
    events = [chunk.split("\n") for chunk in streamed.text.strip().split("\n\n")]
    kinds = [e[0].removeprefix("event: ") for e in events]
    assert kinds[0] == "response.created" and kinds[-2:] == ["error", "response.failed"]
    failed = json.loads(events[-1][1].removeprefix("data: "))["response"]
    assert failed["status"] == "failed" and "injected fault" in failed["error"]["message"]
    good = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    assert good.status == "incomplete"
