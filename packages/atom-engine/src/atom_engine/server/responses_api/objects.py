"""What `/v1/responses` answers: the response object, its output items, and the events of its
stream (OpenAI's shapes; every event has its `type` and a `sequence_number` from 0)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    """OpenAI's ids: `resp_...`, `msg_...`, `fc_...`, `call_...`, `rs_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionToolCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class ReasoningOutput(BaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)  # ATOM writes no summaries
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | FunctionToolCall | ReasoningOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=dict)
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: Literal[True] = True


# -- stream events ----------------------------------------------------------------------------


class _Event(BaseModel):
    sequence_number: int = 0  # set when sent


class ResponseLifecycleEvent(_Event):
    type: Literal[
        "response.created",
        "response.in_progress",
        "response.completed",
        "response.incomplete",
        "response.failed",
    ]
    response: ResponseObject


class OutputItemEvent(_Event):
    type: Literal["response.output_item.added", "response.output_item.done"]
    output_index: int
    item: OutputItem


class ContentPartEvent(_Event):
    type: Literal["response.content_part.added", "response.content_part.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    part: OutputText | ReasoningText


class TextDeltaEvent(_Event):
    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    item_id: str
    output_index: int
    content_index: int = 0
    delta: str
    logprobs: list[Any] = Field(default_factory=list)


class TextDoneEvent(_Event):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    item_id: str
    output_index: int
    content_index: int = 0
    text: str
    logprobs: list[Any] = Field(default_factory=list)


class ArgumentsDeltaEvent(_Event):
    type: Literal["response.function_call_arguments.delta"] = (
        "response.function_call_arguments.delta"
    )
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(_Event):
    type: Literal["response.function_call_arguments.done"] = "response.function_call_arguments.done"
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(_Event):
    """The request failed once streaming (the engine failed it, or the server shuts down)."""

    type: Literal["error"] = "error"
    code: str | None = None
    message: str
    param: str | None = None


StreamEvent = (
    ResponseLifecycleEvent
    | OutputItemEvent
    | ContentPartEvent
    | TextDeltaEvent
    | TextDoneEvent
    | ArgumentsDeltaEvent
    | ArgumentsDoneEvent
    | ErrorEvent
)
