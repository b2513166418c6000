"""A Responses request as the chat request it asks for, and a chat reply as Responses output.

Input items become chat messages (a `developer` message is a `system` one: chat templates know
no developer role; `function_call`s an assistant message's `tool_calls`, with the `call_id` as
the call's id; a `function_call_output` a `tool` message), after the stored conversation of
`previous_response_id`, with `instructions` as a first system message. Then the chat path
(`serving_chat.chat_engine_prompt`) does the rest: template, sampling, grammar, tool and
reasoning parsing.
"""

from __future__ import annotations

from typing import Any

from atom_engine.server.protocol import ChatCompletionRequest
from atom_engine.server.responses import ChatResponseMessage
from atom_engine.server.responses_api.objects import (
    FunctionToolCall,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningOutput,
    ReasoningText,
    new_id,
)
from atom_engine.server.responses_api.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)
from atom_engine.server.serving_common import APIError

# A chat request's field -> the Responses field it came from (for 400s naming the field).
FIELD_NAMES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning",
}


def refuse_unsupported(request: ResponsesRequest) -> None:
    """A 400 naming each declared field ATOM cannot honour, when it is set."""
    if request.background:
        raise APIError(
            "background responses are not supported: leave background out (or false)",
            param="background",
        )
    if request.truncation == "auto":
        raise APIError(
            'truncation "auto" is not supported: a conversation longer than the context is a '
            '400 (truncation "disabled")',
            param="truncation",
        )
    if request.include:
        raise APIError(
            f"include {request.include} is not supported: ATOM adds nothing to the output",
            param="include",
        )
    reasoning = request.reasoning
    if reasoning is not None and (reasoning.summary or reasoning.generate_summary):
        raise APIError(
            "reasoning summaries are not supported: leave reasoning.summary out",
            param="reasoning",
        )


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages."""
    if isinstance(request.input, str):
        return [{"role": "user", "content": request.input}]
    messages: list[dict[str, Any]] = []
    for item in request.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # one turn: text, then calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)}
            )
        else:
            assert isinstance(item, ReasoningItem)  # left out of the prompt
    return messages


def chat_request(request: ResponsesRequest, conversation: list[dict]) -> ChatCompletionRequest:
    """The chat request of `request` whose messages are `instructions` (a system message) and
    `conversation` (the earlier turns and this input)."""
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    fields: dict[str, Any] = {
        "messages": system + conversation,
        "max_completion_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "stop": request.stop,
        "top_k": request.top_k,
        "min_p": request.min_p,
        "repetition_penalty": request.repetition_penalty,
        "ignore_eos": request.ignore_eos,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    if request.structured_outputs is not None:
        fields["structured_outputs"] = request.structured_outputs.model_dump(
            by_alias=True, exclude_none=True
        )
    if request.tools is not None:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in request.tools
        ]
    choice = request.tool_choice
    if choice is not None:
        named = {"type": "function", "function": {"name": getattr(choice, "name", None)}}
        fields["tool_choice"] = choice if isinstance(choice, str) else named
    fmt = request.text.format if request.text is not None else None
    if fmt is not None:
        if fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "description": fmt.description}
            schema.update(schema=fmt.schema_, strict=fmt.strict)
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        else:
            fields["response_format"] = {"type": fmt.type}
    if request.reasoning is not None:
        fields["reasoning_effort"] = request.reasoning.effort
    return ChatCompletionRequest.model_validate(fields)


def output_items(message: ChatResponseMessage, status: str) -> list[OutputItem]:
    """A chat reply as output items: its reasoning, its text, its function calls (in the order
    the model wrote them). `status`: the items' status, "completed" or "incomplete"."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        text = ReasoningText(text=message.reasoning_content)
        items.append(ReasoningOutput(id=new_id("rs"), content=[text], status=status))
    if message.content:
        text = OutputText(text=message.content)
        items.append(OutputMessage(id=new_id("msg"), status=status, content=[text]))
    for call in message.tool_calls:
        items.append(
            FunctionToolCall(
                id=new_id("fc"),
                call_id=new_id("call"),
                name=call.function.name,
                arguments=call.function.arguments,
                status=status,
            )
        )
    return items


def assistant_message(items: list[OutputItem]) -> dict[str, Any]:
    """A response's output as the assistant message that the next turn's prompt holds."""
    content = "".join(i.content[0].text for i in items if isinstance(i, OutputMessage))
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = [
        {
            "id": i.call_id,
            "type": "function",
            "function": {"name": i.name, "arguments": i.arguments},
        }
        for i in items
        if isinstance(i, FunctionToolCall)
    ]
    if calls:
        message["tool_calls"] = calls
    return message


def rename_error(error: APIError) -> APIError:
    """A chat-path 400 naming the Responses field (`input`, not `messages`, ...)."""
    if error.param in FIELD_NAMES:
        name = FIELD_NAMES[error.param]
        if error.param != "messages":  # "messages" is a common word in messages
            error.message = error.message.replace(error.param, name)
        error.param = name
    return error
