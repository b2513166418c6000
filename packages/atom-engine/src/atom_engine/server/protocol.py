"""Pydantic models of the OpenAI API subset ATOM serves (completions, chat, models, errors),
and of vLLM's /tokenize and /detokenize.

Requests are strict: a field ATOM does not know is refused (400 naming it) instead of silently
ignored, types are not coerced (`"max_tokens": "3"`, `"stream": "yes"` and `[[false]]` as token
ids are refused), floats must be finite, and every string must be encodable text (no lone UTF-16
surrogates). Declared fields are honoured, or refused with a 400 when set to something ATOM does
not implement (suffix, use_beam_search, store: true, prediction, ...). A null means the field's
default, for every field that has one. The vLLM extensions (top_k,
min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, allowed_token_ids,
prompt_logprobs, chat_template, structured_outputs, ...) are declared with vLLM's names.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# -- errors -----------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- requests ---------------------------------------------------------------------------------


def _find_unencodable(value: Any, path: tuple) -> tuple | None:
    """The path of the first string in `value` that is not encodable UTF-8, or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if isinstance(key, str) and _find_unencodable(key, path) is not None:
            return (*path, key)
        found = _find_unencodable(item, (*path, key))
        if found is not None:
            return found
    return None


def _defaults_for_null(cls: type[BaseModel]) -> frozenset[str]:
    """The keys (aliases) of `cls`'s fields that have a default but do not take None: a null
    there means the default, as OpenAI's API reads an explicit null."""
    keys = _NULL_KEYS.get(cls)
    if keys is None:
        keys = _NULL_KEYS[cls] = frozenset(
            info.alias or name
            for name, info in cls.model_fields.items()
            if not info.is_required() and not _takes_none(info.annotation)
        )
    return keys


_NULL_KEYS: dict[type, frozenset[str]] = {}


def _takes_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None):
        return True
    return any(_takes_none(arg) for arg in get_args(annotation) if get_origin(arg) is not Literal)


def _null_in_schema(schema: dict[str, Any], cls: type[BaseModel]) -> None:
    """The JSON schema says what the server takes: null for each field null defaults."""
    properties = schema.get("properties", {})
    for key in _defaults_for_null(cls):
        prop = properties.get(key)
        if prop is None:
            continue
        outer = {k: prop.pop(k) for k in ("default", "title", "description") if k in prop}
        branches = prop.pop("anyOf", None) or [dict(prop)]
        prop.clear()
        prop.update(anyOf=[*branches, {"type": "null"}], **outer)


class _Request(BaseModel):
    model_config = ConfigDict(
        strict=True, extra="forbid", allow_inf_nan=False, json_schema_extra=_null_in_schema
    )

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            keys = _defaults_for_null(cls)
            if any(value is None and key in keys for key, value in data.items()):
                return {k: v for k, v in data.items() if not (v is None and k in keys)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _encodable_text(cls, data: Any) -> Any:
        # A lone surrogate ("abc\ud800": a JavaScript string cut inside an emoji) parses as
        # JSON but is no text: the tokenizer cannot encode it.
        path = _find_unencodable(data, ())
        if path is not None:
            field = ".".join(str(p) for p in path) or "body"
            raise PydanticCustomError(
                "unencodable_text",
                "{field} is not valid text: it holds a lone UTF-16 surrogate",
                {"field": field, "param": str(path[0]) if path else None},
            )
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: Literal[False] = False  # vLLM's per-chunk usage: not implemented


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Request):
    """vLLM's `structured_outputs` request field: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Request):
    """Fields shared by completion and chat requests."""

    model: str | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # {token id: -100..100} added to the logits
    user: str | None = None  # an end-user id for the operator's logs; no effect on the output
    safety_identifier: str | None = None  # OpenAI's successor of `user`: no effect either
    prompt_cache_key: str | None = None  # a caching hint: ATOM caches prefixes by content
    store: bool | None = None  # ATOM stores nothing: true is refused
    metadata: dict[str, str] | None = None  # tags of a stored completion: none is stored
    service_tier: Literal["auto", "default"] | None = None  # ATOM has one tier
    # vLLM extensions (the OpenAI client sends them through `extra_body`)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False  # not implemented: refused when true
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError(
                "stream_options_without_stream",
                "stream_options is only allowed when stream is true",
                {"param": "stream_options"},
            )
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    # A string, a list of strings, a list of token ids, or a list of token-id lists.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # 0 with echo: score the prompt, generate nothing
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None  # not implemented: refused
    best_of: int | None = None  # only best_of == n is accepted


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, ...) are kept and handed to the chat template.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    role: str
    content: str | list[TextContentPart] | None = None
    name: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # a Jinja template used instead of the model's own
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: at most one call
    modalities: list[Literal["text"]] | None = None  # ATOM answers in text only
    # Handed to chat templates that read it (GPT-OSS's); refused for those that do not.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # Not implemented: refused when set (not null / empty).
    functions: list[FunctionDefinition] | None = None  # deprecated: `tools`
    function_call: Literal["none", "auto"] | FunctionName | None = None  # deprecated
    prediction: dict[str, Any] | None = None  # OpenAI's predicted outputs


# vLLM's /tokenize and /detokenize (vllm/entrypoints/serve/tokenize/protocol.py): a body with
# `messages` is a chat request, any other a completion request.


class TokenizeCompletionRequest(_Request):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(_Request):
    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the tokenizer's own, on top of the template's
    return_token_strs: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None


def _tokenize_kind(data: Any) -> str:
    return "chat" if isinstance(data, dict) and "messages" in data else "completion"


TokenizeRequest = Annotated[
    Annotated[TokenizeCompletionRequest, Tag("completion")]
    | Annotated[TokenizeChatRequest, Tag("chat")],
    Discriminator(_tokenize_kind),
]
TOKENIZE_TAGS = ("completion", "chat")  # in a validation error's location, after "body"


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- responses --------------------------------------------------------------------------------
