"""Tool calls in a model's own text (`tool_choice: "auto"`), one parser per model family's
format, chosen with `atom serve --tool-call-parser NAME` (vLLM's names):

- `hermes` (Qwen2.5, Qwen3, Hermes):
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number, after optional text.
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the reply is one JSON object `{"name": ..., "parameters":
  {...}}` (or `"arguments"`), optionally after `<|python_tag|>`; several are separated by `;`.
- `deepseek_v3` (DeepSeek-V3, R1): after optional text,
  `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (one line; a call per begin/end pair).

`parse(text)` -> (content, calls): the text before the calls (None when blank) and (name,
arguments as JSON text) per call; no calls and the whole text as content when the text holds no
well-formed call. `markup_start(text)` is where tool-call markup begins, or may begin (a marker
cut at the end of the text): a stream sends content up to there only.
"""

from __future__ import annotations

import json
import re

ToolCalls = list[tuple[str, str]]  # (function name, arguments as JSON text)


def _arguments(value) -> str | None:
    """Arguments as JSON text: an object (or its JSON text); None when they are neither."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def _partial_marker_at(text: str, marker: str) -> int | None:
    """Where `marker` starts in `text`, or where a prefix of it ends the text; else None."""
    at = text.find(marker)
    if at >= 0:
        return at
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return len(text) - size
    return None


def _content(text: str) -> str | None:
    return text if text.strip() else None


class ToolParser:
    name = ""

    def markup_start(self, text: str) -> int | None:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str | None, ToolCalls]:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def markup_start(self, text: str) -> int | None:
        return _partial_marker_at(text, self.START)

    def parse(self, text: str) -> tuple[str | None, ToolCalls]:
        start = text.find(self.START)
        if start < 0:
            return _content(text), []
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = json.loads(body)
            except ValueError:
                return _content(text), []
            arguments = _arguments(call.get("arguments", {})) if isinstance(call, dict) else None
            if arguments is None or not isinstance(call.get("name"), str):
                return _content(text), []
            calls.append((call["name"], arguments))
        return _content(text[:start]), calls


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def markup_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        at = len(text) - len(stripped)
        if not stripped or stripped.startswith("{") or stripped.startswith(self.PYTHON_TAG):
            return at
        if self.PYTHON_TAG.startswith(stripped):
            return at
        return None

    def parse(self, text: str) -> tuple[str | None, ToolCalls]:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return _content(text), []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                call, at = decoder.raw_decode(body, at)
            except ValueError:
                return _content(text), []
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return _content(text), []
            arguments = _arguments(call.get("parameters", call.get("arguments", {})))
            if arguments is None:
                return _content(text), []
            calls.append((call["name"], arguments))
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return None, calls


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    START = "<｜tool▁calls▁begin｜>"
    _CALL = re.compile(
        r"<｜tool▁call▁begin｜>(?P<type>.*?)<｜tool▁sep｜>(?P<name>.*?)\n```json\n(?P<args>.*?)\n```"
        r"<｜tool▁call▁end｜>",
        re.DOTALL,
    )

    def markup_start(self, text: str) -> int | None:
        return _partial_marker_at(text, self.START)

    def parse(self, text: str) -> tuple[str | None, ToolCalls]:
        start = text.find(self.START)
        if start < 0:
            return _content(text), []
        calls = []
        for match in self._CALL.finditer(text, start):
            arguments = _arguments(match.group("args"))
            if arguments is None:
                return _content(text), []
            calls.append((match.group("name").strip(), arguments))
        if not calls:
            return _content(text), []
        return _content(text[:start]), calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, DeepSeekV3ToolParser)
}
