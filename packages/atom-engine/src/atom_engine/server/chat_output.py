"""One chat choice's generated text -> its message: `reasoning_content` (a reasoning parser),
`content`, and `tool_calls` (parsed from the model's format with `tool_choice: "auto"`, or the
JSON a "required" / named tool choice constrained the text to). `message` builds the final
message; `delta` the next streamed delta (tool calls arrive whole, in the choice's last chunk).
"""

from __future__ import annotations

import json

from atom_engine.server.protocol import random_id
from atom_engine.server.reasoning import ReasoningParser
from atom_engine.server.responses import (
    ChatResponseMessage,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from atom_engine.server.structured import ToolPlan
from atom_engine.server.tool_parsers import ToolCalls, ToolParser


def constrained_calls(plan: ToolPlan, text: str) -> ToolCalls | None:
    """The calls of a "required" / named reply; None when the text is not complete JSON (it was
    cut by max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        return [(plan.name, json.dumps(value, ensure_ascii=False))]
    return [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]


class ChatOutput:
    def __init__(
        self, plan: ToolPlan, tool_parser: ToolParser | None, reasoning: ReasoningParser | None
    ) -> None:
        self.plan, self.tool_parser, self.reasoning = plan, tool_parser, reasoning
        self.sent_reasoning = self.sent_content = 0
        self.has_tool_calls = False

    def _split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.split(text, final)

    def _parse(self, content: str | None) -> tuple[str | None, ToolCalls]:
        if self.plan.mode in ("required", "named"):
            calls = constrained_calls(self.plan, content or "")
            return (content, []) if calls is None else (None, calls)
        if self.plan.mode == "auto" and content is not None:
            return self.tool_parser.parse(content)
        return content or None, []

    def message(self, text: str) -> ChatResponseMessage:
        reasoning, content = self._split(text, final=True)
        content, calls = self._parse(content)
        self.has_tool_calls = bool(calls)
        return ChatResponseMessage(
            content=content,
            reasoning_content=reasoning,
            tool_calls=[ToolCall(function=FunctionCall(name=n, arguments=a)) for n, a in calls],
        )

    def _streamable(self, content: str) -> str:
        """The part of the content a stream may send before the choice ends."""
        if self.plan.mode in ("required", "named"):
            return ""
        if self.plan.mode == "auto":
            start = self.tool_parser.markup_start(content)
            return content if start is None else content[:start]
        return content

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """What the stream has not sent yet of `text` (the choice's text so far); None when
        nothing new may be sent."""
        reasoning, content = self._split(text, final=finished)
        reasoning, content = reasoning or "", content or ""
        calls: ToolCalls = []
        if finished:
            parsed, calls = self._parse(content or None)
            self.has_tool_calls = bool(calls)
            # Content before the calls (or all of it, when they do not parse).
            content = (parsed or "") if calls else content
        else:
            content = self._streamable(content)
        new_reasoning = reasoning[self.sent_reasoning :]
        new_content = content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        if not (new_reasoning or new_content or calls):
            return None
        return DeltaMessage(
            reasoning_content=new_reasoning or None,
            content=new_content or None,
            tool_calls=[
                DeltaToolCall(
                    index=i,
                    id=random_id("chatcmpl-tool"),
                    type="function",
                    function=FunctionCall(name=name, arguments=arguments),
                )
                for i, (name, arguments) in enumerate(calls)
            ]
            or None,
        )

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason is not None and self.has_tool_calls else reason
