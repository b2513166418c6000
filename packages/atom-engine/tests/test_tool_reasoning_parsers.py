"""The tool-call and reasoning parsers on model-format text, whole and streamed in pieces.

The strings are what the model families write (their chat templates' and model cards' formats):
Qwen2.5 / Qwen3 (hermes), Llama 3.1 (JSON, `<|python_tag|>`), DeepSeek-V3 (its special markers),
DeepSeek-R1 and Qwen3 thinking.
"""

from __future__ import annotations

import json

import pytest

from atom_engine.server.chat_output import ChatOutput
from atom_engine.server.reasoning import REASONING_PARSERS
from atom_engine.server.structured import ToolPlan
from atom_engine.server.tool_parsers import TOOL_PARSERS

QWEN_TWO_CALLS = (
    "I'll check both cities.\n"
    '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, '
    'CA, USA", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, CA, '
    'USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>'
)
LLAMA_CALL = (
    '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", '
    '"unit": "Fahrenheit"}}'
)
DEEPSEEK_CALLS = (
    "Let me look that up."
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    '{"location": "Tokyo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
    'get_time\n```json\n{"timezone": "Asia/Tokyo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)


def _calls(parser: str, text: str):
    content, calls = TOOL_PARSERS[parser]().parse(text)
    return content, [(name, json.loads(arguments)) for name, arguments in calls]


def test_hermes():
    content, calls = _calls("hermes", QWEN_TWO_CALLS)
    assert content == "I'll check both cities.\n"
    assert calls == [
        (
            "get_current_temperature",
            {"location": "San Francisco, CA, USA", "unit": "celsius"},
        ),
        (
            "get_temperature_date",
            {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
        ),
    ]
    assert _calls("hermes", "The weather is sunny.") == ("The weather is sunny.", [])
    # A call whose JSON is cut short is no call: the text stays content.
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert _calls("hermes", broken) == (broken, [])


def test_llama3_json():
    expected = [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})]
    assert _calls("llama3_json", LLAMA_CALL) == (None, expected)
    assert _calls("llama3_json", "<|python_tag|>" + LLAMA_CALL) == (None, expected)
    two = LLAMA_CALL + '; {"name": "get_time", "arguments": {"tz": "PST"}}'
    assert _calls("llama3_json", two) == (None, expected + [("get_time", {"tz": "PST"})])
    assert _calls("llama3_json", "It is 72 degrees.") == ("It is 72 degrees.", [])
    assert _calls("llama3_json", '{"no_name": 1}') == ('{"no_name": 1}', [])


def test_deepseek_v3():
    content, calls = _calls("deepseek_v3", DEEPSEEK_CALLS)
    assert content == "Let me look that up."
    assert calls == [
        ("get_weather", {"location": "Tokyo"}),
        ("get_time", {"timezone": "Asia/Tokyo"}),
    ]
    assert _calls("deepseek_v3", "Sunny, 25°C.") == ("Sunny, 25°C.", [])


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [
        (
            "deepseek_r1",
            "Okay, the user asks for 2 + 2. That is 4.\n</think>\n\nThe answer is **4**.",
            "Okay, the user asks for 2 + 2. That is 4.\n",
            "The answer is **4**.",
        ),
        ("deepseek_r1", "<think>\nHmm.\n</think>\n\nHi!", "\nHmm.\n", "Hi!"),
        (
            "deepseek_r1",
            "Still thinking, cut by max_tokens",
            "Still thinking, cut by max_tokens",
            None,
        ),
        (
            "qwen3",
            "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?",
            "\nThe user greets me.\n",
            "Hello! How can I help?",
        ),
        ("qwen3", "Hello! How can I help?", None, "Hello! How can I help?"),
        ("qwen3", "<think>\n\n</think>\n\nHi.", "\n\n", "Hi."),
    ],
)
def test_reasoning_split_and_stream(parser, text, reasoning, content):
    split = REASONING_PARSERS[parser]().split
    assert split(text) == (reasoning, content)
    # Streamed three characters at a time, the deltas add up to the same parts.
    out = ChatOutput(ToolPlan(), None, REASONING_PARSERS[parser]())
    parts = {"reasoning_content": "", "content": ""}
    for end in [*range(3, len(text), 3), len(text)]:
        delta = out.delta(text[:end], finished=end == len(text))
        for key in parts:
            parts[key] += getattr(delta, key) or "" if delta else ""
    assert parts == {"reasoning_content": reasoning or "", "content": content or ""}


@pytest.mark.parametrize(
    ("parser", "text", "names"),
    [
        ("hermes", QWEN_TWO_CALLS, ["get_current_temperature", "get_temperature_date"]),
        ("llama3_json", "<|python_tag|>" + LLAMA_CALL, ["get_current_conditions"]),
        ("deepseek_v3", DEEPSEEK_CALLS, ["get_weather", "get_time"]),
    ],
)
def test_streamed_tool_calls(parser, text, names):
    """A stream sends the content before the markup as it comes, never the markup, then the
    calls whole in the last delta; the message of the whole text says the same."""
    plan = ToolPlan("auto")
    out = ChatOutput(plan, TOOL_PARSERS[parser](), REASONING_PARSERS["qwen3"]())
    content, calls = "", []
    for end in [*range(2, len(text), 2), len(text)]:
        delta = out.delta(text[:end], finished=end == len(text))
        if delta is not None:
            content += delta.content or ""
            calls += delta.tool_calls or []
            assert "<" not in (delta.content or "") and "{" not in (delta.content or "")
    assert [c.function.name for c in calls] == names
    assert [c.index for c in calls] == list(range(len(names)))
    assert out.finish_reason("stop") == "tool_calls"
    final = ChatOutput(plan, TOOL_PARSERS[parser](), None).message(text)
    assert (final.content or "") == content
    assert [(c.function.name, c.function.arguments) for c in final.tool_calls] == [
        (c.function.name, c.function.arguments) for c in calls
    ]
    assert len({c.id for c in final.tool_calls}) == len(names)


def test_plain_reply_streams_through_auto():
    out = ChatOutput(ToolPlan("auto"), TOOL_PARSERS["hermes"](), None)
    text = "Paris is the capital of France. Use <b>bold</b> sparingly."
    sent = "".join(
        (d.content or "")
        for end in range(1, len(text) + 1)
        if (d := out.delta(text[:end], finished=end == len(text)))
    )
    assert sent == text and out.finish_reason("stop") == "stop"


def test_serve_flags_name_every_parser():
    """`atom serve` lists the parsers' names without importing the server: they must agree."""
    from atom_engine.cli.main import build_parser

    args = build_parser().parse_args(
        ["serve", "--tool-call-parser", "llama3_json", "--reasoning-parser", "qwen3"]
    )
    assert (args.tool_call_parser, args.reasoning_parser) == ("llama3_json", "qwen3")
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    choices = {a.dest: set(a.choices) for a in serve._actions if a.choices}
    assert choices["tool_call_parser"] == set(TOOL_PARSERS)
    assert choices["reasoning_parser"] == set(REASONING_PARSERS)
