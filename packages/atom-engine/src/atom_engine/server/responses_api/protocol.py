"""The request body of `POST /v1/responses` (OpenAI's Responses API, the subset vLLM serves).

Strict like the chat request (`server/protocol.py`): an unknown field is a 400 naming it, and a
declared field ATOM cannot honour is refused when set (`background: true`, `truncation: "auto"`,
`include` values, `reasoning.summary`, built-in tools such as `web_search`). `input` is a string
(one user message) or a list of items: messages (role user / system / developer / assistant,
content a string or `input_text` / `output_text` parts), `function_call`s, their
`function_call_output`s, and `reasoning` items (a previous response's output fed back).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator
from pydantic_core import PydanticCustomError

from atom_engine.server.protocol import StructuredOutputsRequest, _Request

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class TextPart(_Request):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # a previous response's output_text: ignored
    logprobs: list[Any] | None = None  # likewise


class MessageItem(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: ItemStatus | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningPart(_Request):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Request):
    """A previous response's reasoning: accepted, and left out of the prompt (chat templates
    drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    status: ItemStatus | None = None


def _item_kind(data: Any) -> str | None:
    if isinstance(data, dict):
        return data.get("type", "message")  # an "easy" message has no type
    return getattr(data, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(_Request):
    """Responses' flat function tool (chat nests these under `function`)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"]
    name: str


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema's
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ReasoningConfig(_Request):
    # Handed to chat templates that read it (as chat's reasoning_effort); refused otherwise.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Not implemented (ATOM writes no summaries): refused when set.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None  # a system message first; not carried to the next turn
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True  # kept for previous_response_id and GET /v1/responses/{id}
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None  # an end-user id for the operator's logs; no effect
    safety_identifier: str | None = None  # no effect either
    prompt_cache_key: str | None = None  # ATOM caches prefixes by content
    metadata: dict[str, str] | None = None  # returned with the response (and stored)
    service_tier: Literal["auto", "default"] | None = None  # ATOM has one tier
    # Not implemented: refused when set to anything but these defaults.
    background: bool = False
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    # vLLM extensions (the OpenAI client sends them through `extra_body`)
    seed: int | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    structured_outputs: StructuredOutputsRequest | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, tools: Any) -> Any:
        for tool in tools if isinstance(tools, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise PydanticCustomError(
                    "unsupported_tool",
                    "the built-in tool '{kind}' is not supported: ATOM serves function tools only",
                    {"kind": kind},
                )
        return tools
