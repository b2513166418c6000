"""An Anthropic Messages request -> the chat completion request it means (vLLM's
`entrypoints/anthropic` does the same), so /v1/messages runs the chat path: chat template,
sampling, tool plan, tool-call and reasoning parsers.

- `system` -> a leading system message (text blocks joined by newlines);
- a user turn's `tool_result` blocks -> `tool` messages (in order, before the turn's text, as
  chat templates want them right after the assistant's calls);
- an assistant turn's `tool_use` blocks -> its `tool_calls`, its `thinking` blocks -> its
  `reasoning_content` (what Qwen3's and DeepSeek-R1's templates read);
- `tools` -> function tools; `tool_choice` auto / any / tool / none -> "auto" / "required" /
  named / "none" (`disable_parallel_tool_use` -> `parallel_tool_calls: false`);
- `thinking` -> `enable_thinking` for a template that reads it (Qwen3's); enabled needs the
  server's `--reasoning-parser` (the thinking blocks come from it);
- `stop_sequences` -> `stop`; `max_tokens`, `temperature`, `top_p`, `top_k` as they are.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from atom_engine.chat_template import template_reads
from atom_engine.server.anthropic_protocol import (
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    TextBlock,
    Thinking,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from atom_engine.server.protocol import ChatCompletionRequest
from atom_engine.server.serving_common import APIError, ServerState

# The chat request's field names a 400 may name -> the Anthropic request's.
_FIELD_NAMES = {"stop": "stop_sequences", "chat_template_kwargs": "thinking"}


def anthropic_names(error: APIError) -> APIError:
    """`error` (from the chat path) naming the Anthropic request's fields."""
    new = _FIELD_NAMES.get(error.param or "")
    if new is not None:
        error.message = re.sub(rf"\b{error.param}\b", new, error.message)
        error.param = new
    return error


def _text(blocks: str | list[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(block.text for block in blocks)


def _refuse(where: str, block: Any, role: str) -> APIError:
    return APIError(
        f"{where}: a {block.type} block is not allowed in a {role} message", param="messages"
    )


def _user_turn(message: InputMessage, where: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    tool_messages, texts = [], []
    for i, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            entry = {
                "role": "tool",
                "tool_call_id": block.tool_use_id,
                "content": _text(block.content),
            }
            if block.is_error:
                entry["is_error"] = True  # for a template that reads it
            tool_messages.append(entry)
        else:
            raise _refuse(f"{where}.content.{i}", block, "user")
    if texts or not tool_messages:
        tool_messages.append({"role": "user", "content": "\n".join(texts)})
    return tool_messages


def _assistant_turn(message: InputMessage, where: str) -> dict[str, Any]:
    if isinstance(message.content, str):
        return {"role": "assistant", "content": message.content}
    texts, thoughts, calls = [], [], []
    for i, block in enumerate(message.content):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            raise _refuse(f"{where}.content.{i}", block, "assistant")
    entry: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        entry["reasoning_content"] = "\n".join(thoughts)
    if calls:
        entry["tool_calls"] = calls
    return entry


def chat_messages_of(request: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = _text(request.system)
    if request.system is not None:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        if message.role == "user":
            messages += _user_turn(message, f"messages.{i}")
        else:
            messages.append(_assistant_turn(message, f"messages.{i}"))
    return messages


def _tool_choice(request: CountTokensRequest) -> dict[str, Any]:
    """The chat request's tool_choice and parallel_tool_calls."""
    choice = request.tool_choice
    if choice is None:
        return {}
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        if choice.name is None:
            raise APIError('tool_choice of type "tool" needs a name', param="tool_choice")
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        return fields
    if choice.name is not None:
        raise APIError('tool_choice.name goes with type "tool" only', param="tool_choice")
    fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def _thinking_kwargs(
    state: ServerState, thinking: Thinking | None, max_tokens: int | None
) -> dict[str, Any] | None:
    """The chat template kwargs of `thinking`; a 400 when the server cannot honour it."""
    reads = template_reads(state.engine.tokenizer, None, "enable_thinking")
    if thinking is None:  # Anthropic's default is no thinking (Qwen3's template thinks unless told)
        return {"enable_thinking": False} if reads else None
    if thinking.type != "enabled" and thinking.budget_tokens is not None:
        raise APIError("thinking.budget_tokens goes with type enabled", param="thinking")
    if thinking.type == "disabled":
        return {"enable_thinking": False} if reads else None
    if state.reasoning_parser is None:
        raise APIError(
            f'thinking of type "{thinking.type}" needs a reasoning parser for the model\'s '
            "format: start the server with --reasoning-parser (deepseek_r1, qwen3)",
            param="thinking",
        )
    budget = thinking.budget_tokens
    if thinking.type == "adaptive":
        return {"enable_thinking": True} if reads else None
    if budget is None or budget < 1 or (max_tokens is not None and budget >= max_tokens):
        raise APIError(
            "thinking.budget_tokens must be at least 1 and less than max_tokens", param="thinking"
        )
    return {"enable_thinking": True} if reads else None


def to_chat_request(state: ServerState, request: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request of an Anthropic one; a 400 for what it cannot express."""
    is_generation = isinstance(request, MessagesRequest)
    max_tokens = request.max_tokens if is_generation else None
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": chat_messages_of(request),
        **_tool_choice(request),
    }
    if request.tools is not None:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description,
                    "parameters": tool.input_schema,
                },
            }
            for tool in request.tools
        ]
    thinking, choice = request.thinking, request.tool_choice
    if thinking is not None and thinking.type != "disabled" and choice is not None:
        if choice.type in ("any", "tool"):  # as Anthropic's API: a forced call has no thinking
            raise APIError(
                "thinking may not be enabled when tool_choice forces tool use (any or tool)",
                param="thinking",
            )
    kwargs = _thinking_kwargs(state, thinking, max_tokens)
    if kwargs is not None:
        fields["chat_template_kwargs"] = kwargs
    if is_generation:
        fields.update(
            max_tokens=request.max_tokens,
            stop=request.stop_sequences,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stream=request.stream,
        )
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:  # a value the chat request takes in no form
        raise APIError(f"invalid request: {e.errors()[0]['msg']}") from None
