"""Structured output, tool calls and reasoning through `atom serve`: the official `openai` client
against a real uvicorn on loopback, on the bundled SmolLM2 (the session's `smollm2_engine`).

Two apps share the engine: a plain one, and one started with `--tool-call-parser hermes
--reasoning-parser deepseek_r1`. Answers are checked against their schema with `jsonschema`.
Requests run concurrently where they can (they share engine steps) and keep max_tokens small.
"""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from atom_engine.server.api_server import build_app
from atom_engine.testing import serve, wait_idle

MODEL = "smollm2-test"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "pop": {"type": "integer", "minimum": 0, "maximum": 40},
        "nick": {"type": "string", "maxLength": 8},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "pop", "nick", "capital"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["utc_offset"],
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_CITY = [{"role": "user", "content": "Describe Paris as JSON."}]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Tokyo?"}]


@pytest.fixture(scope="module")
def engine(smollm2_engine):
    return smollm2_engine


@pytest.fixture(scope="module")
def server(engine):
    server = serve(build_app(engine, MODEL), engine)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=300)


@pytest.fixture(scope="module")
def parser_client(engine):
    app = build_app(engine, MODEL, tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    server = serve(app, engine)
    yield server.client(timeout=300)
    server.stop()


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _chat_text(client, stream: bool, **kwargs) -> tuple[str, str]:
    """(content, finish_reason) of a chat request, streamed or not."""
    if not stream:
        choice = client.chat.completions.create(model=MODEL, **kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_json_schema_at_every_temperature(client):
    cases = [(t, stream) for t in (0.0, 0.7, 1.0, 1.3) for stream in (False, True)]

    def run(case):
        temperature, stream = case
        return _chat_text(
            client,
            stream,
            messages=ASK_CITY,
            response_format=_json_schema(CITY),
            temperature=temperature,
            seed=7,
            max_tokens=80,
        )

    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for case, (text, finish) in zip(cases, results, strict=True):
        assert finish == "stop", (case, text)
        jsonschema.validate(json.loads(text), CITY)
    # Greedy: streamed and not give the same answer.
    assert results[0] == results[1]


def test_json_object_and_structured_outputs_kinds(client):
    prompt = "Q: Give a short answer.\nA:"
    kinds = {
        "json_object": {"extra_body": {"response_format": {"type": "json_object"}}},
        "json": {"extra_body": {"structured_outputs": {"json": CITY}}},
        "regex": {"extra_body": {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,5}"}}},
        "choice": {"extra_body": {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}},
        "grammar": {
            "extra_body": {
                "structured_outputs": {"grammar": 'root ::= "The answer is " ("yes" | "no") "."'}
            }
        },
    }

    def run(kind):
        return client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=64, temperature=0.8, seed=3, **kinds[kind]
        ).choices[0]

    with ThreadPoolExecutor(len(kinds)) as pool:
        choices = dict(zip(kinds, pool.map(run, kinds), strict=True))
    for kind, choice in choices.items():
        assert choice.finish_reason == "stop", (kind, choice.text)
    assert isinstance(json.loads(choices["json_object"].text), dict)
    jsonschema.validate(json.loads(choices["json"].text), CITY)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", choices["regex"].text)
    assert choices["choice"].text in ("yes", "no", "maybe")
    assert choices["grammar"].text in ("The answer is yes.", "The answer is no.")


def test_n_stop_strings_and_grammar_end(client):
    # n > 1: every choice follows the schema.
    out = client.chat.completions.create(
        model=MODEL,
        messages=ASK_CITY,
        response_format=_json_schema(CITY),
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=80,
    )
    assert len(out.choices) == 2
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), CITY)
    # A stop string cuts a constrained answer like any other.
    out = client.completions.create(
        model=MODEL,
        prompt="My favourite thing:",
        max_tokens=8,
        temperature=0,
        stop=[" "],
        extra_body={"structured_outputs": {"regex": "(red|blue) (car|boat)"}},
    )
    assert out.choices[0].text in ("red", "blue") and out.choices[0].finish_reason == "stop"
    # The request ends when the grammar is complete, even with ignore_eos.
    out = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer:",
        max_tokens=16,
        temperature=0,
        extra_body={"structured_outputs": {"choice": [" yes", " no"]}, "ignore_eos": True},
    )
    assert out.choices[0].text in (" yes", " no") and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens <= 3


def _check_calls(calls, names):
    assert calls and all(c.type == "function" and c.id for c in calls)
    for call in calls:
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_tool_choice_required_and_named(client):
    named = {"type": "function", "function": {"name": "get_time"}}

    def run(case):
        tool_choice, stream = case
        kwargs = dict(
            model=MODEL,
            messages=ASK_WEATHER,
            tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=60,
            temperature=0,
            # NOTE: greedy, the bundled model repeats calls in a "required" list until max_tokens
            # (measured: get_time 4 times in 60 tokens): one call per reply here.
            parallel_tool_calls=False,
        )
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            return choice.message.tool_calls, choice.finish_reason, choice.message.content
        calls, finish, content = [], None, ""
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                calls += choice.delta.tool_calls or []
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return calls, finish, content or None

    cases = [("required", False), ("required", True), (named, False), (named, True)]
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(run, cases))
    for (tool_choice, _), (calls, finish, content) in zip(cases, results, strict=True):
        assert finish == "tool_calls" and content is None, (tool_choice, content)
        _check_calls(calls, ["get_time"] if tool_choice is named else list(PARAMETERS))
    assert all(len(calls) == 1 for calls, _, _ in results)
    # Greedy streamed and not agree on the calls.
    for a, b in ((0, 1), (2, 3)):
        assert [(c.function.name, c.function.arguments) for c in results[a][0]] == [
            (c.function.name, c.function.arguments) for c in results[b][0]
        ]
    # Several calls allowed: a list cut by max_tokens is no call; it comes back as content.
    out = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", max_tokens=30
    )
    choice = out.choices[0]
    if choice.finish_reason == "tool_calls":
        _check_calls(choice.message.tool_calls, list(PARAMETERS))
    else:
        assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert choice.message.content.startswith('[{"name": "get_')


def test_tool_choice_none_and_auto(client):
    out = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    choice = out.choices[0]
    assert choice.message.content and not choice.message.tool_calls
    assert choice.finish_reason == "length"
    # "auto" (also the default with tools) needs a tool-call parser.
    for extra in ({"tool_choice": "auto"}, {}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=4, **extra
            )
        assert e.value.body["param"] == "tool_choice" and "--tool-call-parser" in str(e.value)


def test_chat_template_receives_tools_and_kwargs(client):
    template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if tools %}{% for t in tools %} tool {{ t.function.name }}{% endfor %}{% endif %}"
        "{% if shout %} LOUDLY AND AT LENGTH{% endif %}"
    )

    def prompt_tokens(**kwargs):
        out = client.chat.completions.create(
            model=MODEL,
            messages=ASK_WEATHER,
            max_tokens=1,
            extra_body={"chat_template": template, **kwargs.pop("extra_body", {})},
            **kwargs,
        )
        return out.usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") > plain
    assert prompt_tokens(extra_body={"chat_template_kwargs": {"shout": True}}) > plain


def test_bad_requests_are_400_and_the_server_goes_on(client, engine):
    chat = {"model": MODEL, "messages": ASK_CITY, "max_tokens": 4}
    cases = [
        ({"response_format": _json_schema({"type": "foo"})}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"extra_body": {"structured_outputs": {"regex": "(ab"}}}, "structured_outputs"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "root ::= nope"}}},
            "structured_outputs",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
            "structured_outputs",
        ),
        ({"extra_body": {"structured_outputs": {"whitespace": "x"}}}, "structured_outputs"),
        (
            {
                "response_format": {"type": "json_object"},
                "extra_body": {"structured_outputs": {"regex": "a"}},
            },
            "structured_outputs",
        ),
        (
            {"response_format": {"type": "json_object"}, "extra_body": {"min_tokens": 2}},
            "min_tokens",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**chat, **kwargs)
        assert e.value.body["param"] == param, (kwargs, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL,
            prompt="x",
            max_tokens=4,
            extra_body={"response_format": {"type": "json_schema"}},
        )
    assert e.value.body["param"] == "response_format"
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4)
    assert out.choices[0].text and out.choices[0].finish_reason == "length"
    wait_idle(engine)


def test_unconstrained_neighbours_unchanged(server):
    """Greedy unconstrained requests batched with constrained ones give the text they give
    beside unconstrained neighbours of the same lengths."""
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    constrained = {"structured_outputs": {"regex": "[a-z]{4,30}"}}

    async def batch(neighbour_extra):
        plain = [
            client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0)
            for p in prompts
        ]
        neighbours = [
            client.completions.create(
                model=MODEL,
                prompt=p,
                max_tokens=12,
                temperature=0.9,
                seed=1,
                extra_body=neighbour_extra,
            )
            for p in prompts
        ]
        outs = await asyncio.gather(*plain, *neighbours)
        return [o.choices[0].text for o in outs[: len(prompts)]], outs[len(prompts) :]

    async def main():
        alone, _ = await batch({})
        beside, neighbours = await batch(constrained)
        return alone, beside, neighbours

    alone, beside, neighbours = asyncio.run(main())
    assert beside == alone
    assert all(re.fullmatch("[a-z]{4,30}", n.choices[0].text) for n in neighbours)


def test_auto_tool_call_and_reasoning_end_to_end(parser_client):
    """--tool-call-parser hermes and --reasoning-parser deepseek_r1 on the model's text. The
    bundled model was not trained on either format, so a regex has it write them (as a model
    trained on them would): reasoning, then a Hermes tool call."""
    regex = (
        r"[A-Za-z ]{1,24}\n</think>\n\n<tool_call>\n"
        r'\{"name": "get_weather", "arguments": \{"city": "(Paris|Tokyo)", "unit": "celsius"\}\}'
        r"\n</tool_call>"
    )
    kwargs = dict(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        # NOTE: the forced markup takes ~60 tokens: the model spells it in short pieces.
        max_tokens=128,
        temperature=0,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    choice = parser_client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    message = choice.message
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    assert message.content is None
    _check_calls(message.tool_calls, ["get_weather"])
    reasoning, calls, content, finish = "", [], "", None
    for chunk in parser_client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert reasoning == message.reasoning_content and content == "" and finish == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls
    ]
    # A plain reply with reasoning and content (no tools).
    out = parser_client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        max_tokens=32,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"[a-z ]{1,12}\n</think>\n\nSunny\."}},
    )
    message = out.choices[0].message
    assert message.reasoning_content.endswith("\n") and message.content == "Sunny."
