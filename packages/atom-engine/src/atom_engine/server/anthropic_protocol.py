"""Pydantic models of the Anthropic Messages API subset ATOM serves (`POST /v1/messages`,
`/v1/messages/count_tokens`): requests, response bodies, stream events and errors.

Requests are as strict as the OpenAI ones (`protocol._Request`): an unknown field is a 400 naming
it. Content blocks are `text`, `tool_use`, `tool_result` (its content a string or text blocks)
and, in assistant turns, `thinking`; any other block type (image, document, search_result,
server tools' blocks) is refused by the `type` check. `cache_control` is accepted anywhere
Anthropic allows it and has no effect (ATOM caches prompt prefixes by content); `metadata` is
accepted with no effect on the output.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Discriminator, Field

from atom_engine.server.protocol import _Request


def anthropic_id(prefix: str) -> str:
    """Anthropic's ids: `msg_...`, `toolu_...` (24 base-62-ish characters; hex here)."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# -- requests ---------------------------------------------------------------------------------


class CacheControl(_Request):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = Field(default=None, max_length=0)  # not implemented


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Request):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # ATOM's own are empty; any is accepted back


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Discriminator("type"),
]


class InputMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Request):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    # Client tools only: server tools (web_search_..., bash_..., text_editor_...) are refused.
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = None


class Thinking(_Request):
    # "adaptive": the model decides how long it reasons (enabled, with no budget)
    type: Literal["enabled", "adaptive", "disabled"]
    # With "enabled": after this many output tokens the end-of-reasoning marker is forced (the
    # sampler's thinking_budget); >= 1 and < max_tokens (Anthropic's own floor of 1024 is not
    # required). The reasoning and the answer share max_tokens.
    budget_tokens: int | None = None
    display: Literal["summarized"] | None = None  # thinking is shown; "omitted" is not implemented


class Metadata(_Request):
    user_id: str | None = None  # an end-user id for the operator's logs; no effect


class CountTokensRequest(_Request):
    """POST /v1/messages/count_tokens: the prompt part of a messages request."""

    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    stream: bool = False
    cache_control: CacheControl | None = None  # ATOM caches prompt prefixes anyway: no effect


# -- responses --------------------------------------------------------------------------------


class ResponseTextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseThinkingBlock(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # ATOM signs nothing


class ResponseToolUseBlock(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ResponseBlock = Annotated[
    ResponseTextBlock | ResponseThinkingBlock | ResponseToolUseBlock, Discriminator("type")
]
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseBlock]
    stop_reason: StopReason | None = None  # null only in a stream's message_start
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int


# -- stream events ----------------------------------------------------------------------------


class MessageStartEvent(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessagesResponse


class ContentBlockStartEvent(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ResponseBlock


class PingEvent(BaseModel):
    type: Literal["ping"] = "ping"


class TextDelta(BaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(BaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class InputJsonDelta(BaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class ContentBlockDeltaEvent(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | InputJsonDelta, Discriminator("type")]


class ContentBlockStopEvent(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(BaseModel):
    stop_reason: StopReason
    stop_sequence: str | None = None


class DeltaUsage(BaseModel):
    output_tokens: int


class MessageDeltaEvent(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: DeltaUsage


class MessageStopEvent(BaseModel):
    type: Literal["message_stop"] = "message_stop"


# -- errors -----------------------------------------------------------------------------------

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """The error body of /v1/messages routes (also a stream's `event: error` data)."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    info = AnthropicErrorInfo(type=ERROR_TYPES.get(status, "api_error"), message=message)
    return AnthropicErrorResponse(error=info).model_dump()


def messages_error_response(status: int, message: str) -> JSONResponse:
    """An error of the /v1/messages routes, in Anthropic's shape."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)


def _is_union_branch(part: Any) -> bool:
    # pydantic names the member of a union it tried: "str", "list[tagged-union[...]]", "int"
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def messages_validation_message(errors: list[dict[str, Any]]) -> str:
    """pydantic's errors of a messages request as one message naming the fields at fault. Of
    a field that may be a string or a list of blocks, the list's error is the one told."""
    parts: list[str] = []
    by_field: dict[str, list[tuple[str, str]]] = {}
    for error in errors:
        if error.get("type") == "json_invalid":
            return f"the request body is not valid JSON: {error.get('msg')}"
        loc = [str(x) for x in error.get("loc", ()) if x != "body" and not _is_union_branch(x)]
        where = ".".join(loc) or "body"
        kind = error.get("type")
        if kind == "extra_forbidden":
            text = f"{where}: unknown or unsupported field (ATOM does not implement it)"
        elif kind == "union_tag_invalid":
            tag = (error.get("ctx") or {}).get("tag")
            text = f"{where}: content blocks of type {tag!r} are not supported (ATOM takes " + (
                f"{(error.get('ctx') or {}).get('expected_tags')})"
            )
        else:
            text = f"{where}: {error.get('msg')}"
        by_field.setdefault(where.split(".")[0], []).append((kind, text))
    for entries in by_field.values():
        # A string-or-list field: drop "should be a valid string" when the list part erred.
        if len(entries) > 1:
            entries = [e for e in entries if e[0] != "string_type"] or entries
        parts += [text for _, text in entries]
    return "invalid request: " + "; ".join(parts)


MESSAGES_PATH = "/v1/messages"


def is_messages_path(path: str) -> bool:
    """The routes whose errors take Anthropic's shape: /v1/messages and below it."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


STREAM_EVENTS = (
    MessageStartEvent,
    ContentBlockStartEvent,
    PingEvent,
    ContentBlockDeltaEvent,
    ContentBlockStopEvent,
    MessageDeltaEvent,
    MessageStopEvent,
    AnthropicErrorResponse,
)
