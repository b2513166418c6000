"""The server's OpenAPI document, as the server answers (`/openapi.json`, `/docs`).

FastAPI's own document describes FastAPI's defaults: 422 for validation errors (this server
answers 400), JSON for every route (`/health` answers an empty body, `/metrics` Prometheus text,
a streamed completion `text/event-stream`) and no schema for the completion responses (the
handlers return their responses themselves). `install_openapi` replaces each operation's
responses with what the server sends: its success bodies, and the OpenAI-style error body
(`ErrorResponse`) for each status that can occur there (Anthropic's, `AnthropicErrorResponse`,
on `/v1/messages` and `/v1/messages/count_tokens`, whose stream is of named events).

The request schemas (pydantic's, from the request models) also get the ranges the server
checks, so that generated clients and fuzzers know them: sampling values, token ids within the
served model's vocabulary, `n` up to its batch size. A value within them can still be refused
(400) when it conflicts with another field or the prompt does not fit the context.

A streamed response (`"stream": true`) is documented as `text/event-stream` whose `schema`
describes one event, as OpenAPI 3.2's `itemSchema` does (tools such as schemathesis read it so
in 3.1 documents): its `data` is a chunk, an error (the request failed after the stream began),
or the final `[DONE]`. `/v1/responses` streams named events instead (`event: <type>`, `data:
<event>`, no `[DONE]`): its event `schema` has both fields.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from atom_engine.server.anthropic_protocol import (
    STREAM_EVENTS,
    AnthropicErrorResponse,
    CountTokensResponse,
    MessagesResponse,
)
from atom_engine.server.openapi_bounds import bound, request_bounds
from atom_engine.server.protocol import ErrorResponse
from atom_engine.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
)
from atom_engine.server.responses_api.objects import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    DeletedResponse,
    ErrorEvent,
    OutputItemEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
)

JSON, SSE, TEXT = "application/json", "text/event-stream", "text/plain"
_REF = "#/components/schemas/{model}"


class VersionInfo(BaseModel):
    version: str


class ProfileStatus(BaseModel):
    status: Literal["profiling", "stopped"]
    directory: str  # where the trace is written


# The events of a streamed /v1/responses.
_RESPONSE_EVENTS = (
    ResponseLifecycleEvent,
    OutputItemEvent,
    ContentPartEvent,
    TextDeltaEvent,
    TextDoneEvent,
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ErrorEvent,
)

_RESPONSE_MODELS = (
    ErrorResponse,
    ModelList,
    CompletionResponse,
    CompletionChunk,
    ChatCompletionResponse,
    ChatCompletionChunk,
    VersionInfo,
    ProfileStatus,
    TokenizeResponse,
    DetokenizeResponse,
    CountTokensResponse,
    *STREAM_EVENTS,  # MessagesResponse and AnthropicErrorResponse among them
    ResponseObject,
    DeletedResponse,
    *_RESPONSE_EVENTS,
)

_ERRORS = {
    400: "The request is invalid: malformed JSON, a field of the wrong type, out of range or "
    "unknown, a prompt longer than the context; `error.param` names the field.",
    401: "The server runs with `--api-key` and neither `Authorization: Bearer` nor `x-api-key` "
    "carries it.",
    404: "The `model` is not served here.",
    413: "The request body is larger than the server's limit (`--max-request-body-bytes`).",
    500: "An internal error; the connection stays open and other requests go on.",
    503: "The server is shutting down, or its engine has stopped.",
}
_ERRORS_OF_GENERATION = {
    **_ERRORS,
    500: "The engine failed this request (other requests go on); the connection stays open.",
    503: "The server is shutting down (the request was ended by the drain timeout), or its "
    "engine has stopped.",
}
_PROFILE_400 = (
    "Profiling is not enabled (`--profiler-dir` / `ATOM_TORCH_PROFILER_DIR`), is already "
    "running (start) or is not running (stop)."
)


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": _REF.format(model=model.__name__)}


def _error(status: int, description: str, body: type[BaseModel] = ErrorResponse) -> dict[str, Any]:
    response: dict[str, Any] = {
        "description": description,
        "content": {JSON: {"schema": _ref(body)}},
    }
    if status == 401:
        response["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return response


def _errors(
    statuses: tuple[int, ...],
    descriptions: dict[int, str] = _ERRORS,
    body: type[BaseModel] = ErrorResponse,
) -> dict:
    return {str(status): _error(status, descriptions[status], body) for status in statuses}


def _sse_event(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event of a stream of `chunk`s: `data: <chunk or error JSON>` or
    `data: [DONE]`."""
    payload = {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}
    data = {
        "type": "string",
        "if": {"const": "[DONE]"},
        "then": True,
        "else": {"contentMediaType": JSON, "contentSchema": payload},
    }
    return {"type": "object", "properties": {"data": data}, "required": ["data"]}


def _generation(response: type[BaseModel], chunk: type[BaseModel]) -> dict[str, Any]:
    ok = {
        "description": f"`{response.__name__}` as JSON; with `stream: true`, server-sent events "
        f"(`data: <{chunk.__name__}>`, or an `ErrorResponse` if the request fails once "
        "streaming, then `data: [DONE]`).",
        "content": {
            JSON: {"schema": _ref(response)},
            SSE: {"schema": _sse_event(chunk)},
        },
    }
    statuses = (400, 401, 404, 413, 500, 503)
    return {"200": ok, **_errors(statuses, _ERRORS_OF_GENERATION)}


_MESSAGES_ERRORS = {
    **_ERRORS_OF_GENERATION,
    400: "`invalid_request_error`: malformed JSON, a field of the wrong type, out of range, "
    "unknown or not implemented (image blocks, server tools, ...), a prompt longer than the "
    "context; the message names the field.",
    401: "`authentication_error`: the server runs with `--api-key` and neither `x-api-key` nor "
    "`Authorization: Bearer` carries it.",
    404: "`not_found_error`: the `model` is not served here.",
}


def _messages() -> dict[str, Any]:
    """POST /v1/messages: Anthropic's message, or its named events, errors in its shape."""
    event = {
        "type": "object",
        "properties": {
            "event": {"enum": [m.model_fields["type"].default for m in STREAM_EVENTS]},
            "data": {
                "type": "string",
                "contentMediaType": JSON,
                "contentSchema": {"anyOf": [_ref(m) for m in STREAM_EVENTS]},
            },
        },
        "required": ["event", "data"],
    }
    ok = {
        "description": "`MessagesResponse` as JSON; with `stream: true`, Anthropic's server-sent "
        "events (`event: <type>` and `data: <its JSON>`: message_start, ping, content_block_start"
        " / _delta / _stop, message_delta, message_stop; `error` if the request fails once "
        "streaming).",
        "content": {JSON: {"schema": _ref(MessagesResponse)}, SSE: {"schema": event}},
    }
    statuses = (400, 401, 404, 413, 500, 503)
    return {"200": ok, **_errors(statuses, _MESSAGES_ERRORS, AnthropicErrorResponse)}


def _responses_api() -> dict[tuple[str, str], dict[str, Any]]:
    """/v1/responses: a response, or its events (`event: <type>`, `data: <event>`)."""
    event = {
        "type": "object",
        "properties": {
            "event": {"type": "string"},
            "data": {
                "type": "string",
                "contentMediaType": JSON,
                "contentSchema": {"anyOf": [_ref(e) for e in _RESPONSE_EVENTS]},
            },
        },
        "required": ["event", "data"],
    }
    created = {
        "description": "`ResponseObject` as JSON; with `stream: true`, server-sent events "
        "(`event: <type>` and `data: <event>`, from `response.created` to `response.completed` "
        "or `response.incomplete`; an `error` event if the request fails once streaming).",
        "content": {JSON: {"schema": _ref(ResponseObject)}, SSE: {"schema": event}},
    }
    not_stored = "No stored response has this id (`store: false`, deleted, or evicted)."
    errors = {
        **_ERRORS_OF_GENERATION,
        404: "The `model` is not served here, or `previous_response_id` names no stored response.",
    }
    stored_errors = {**_errors((401, 413, 500)), "404": _error(404, not_stored)}
    return {
        ("/v1/responses", "post"): {
            "200": created,
            **_errors((400, 401, 404, 413, 500, 503), errors),
        },
        ("/v1/responses/{response_id}", "get"): {
            "200": _json_ok(ResponseObject, "The stored response."),
            **stored_errors,
        },
        ("/v1/responses/{response_id}", "delete"): {
            "200": _json_ok(DeletedResponse, "The response was deleted from the store."),
            **stored_errors,
        },
    }


def _json_ok(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"description": description, "content": {JSON: {"schema": _ref(model)}}}


def _responses() -> dict[tuple[str, str], dict[str, Any]]:
    """(path, method) -> the OpenAPI responses of each route the server has."""
    profile_errors = {
        **_errors((413, 500)),
        "400": _error(400, _PROFILE_400),
    }
    return {
        ("/v1/models", "get"): {
            "200": _json_ok(ModelList, "The served model."),
            **_errors((401, 413, 500)),
        },
        ("/v1/completions", "post"): _generation(CompletionResponse, CompletionChunk),
        ("/v1/chat/completions", "post"): _generation(ChatCompletionResponse, ChatCompletionChunk),
        ("/v1/messages", "post"): _messages(),
        ("/v1/messages/count_tokens", "post"): {
            "200": _json_ok(
                CountTokensResponse,
                "The prompt's token count, as `/v1/messages` renders the same request.",
            ),
            **_errors((400, 401, 404, 413, 500), _MESSAGES_ERRORS, AnthropicErrorResponse),
        },
        **_responses_api(),
        ("/tokenize", "post"): {
            "200": _json_ok(
                TokenizeResponse,
                "The prompt's token ids (`messages`: as the chat template renders them), their "
                "count, the context length, and with `return_token_strs` the tokens' strings.",
            ),
            **_errors((400, 401, 404, 413, 500)),
        },
        ("/detokenize", "post"): {
            "200": _json_ok(DetokenizeResponse, "The text of the token ids."),
            **_errors((400, 401, 404, 413, 500)),
        },
        ("/health", "get"): {
            "200": {"description": "The engine is running (an empty body)."},
            **_errors((413, 500)),
            "503": _error(503, "The engine is not running."),
        },
        ("/version", "get"): {
            "200": _json_ok(VersionInfo, "ATOM's version."),
            **_errors((413, 500)),
        },
        ("/metrics", "get"): {
            "200": {
                "description": "Prometheus metrics in the text exposition format 0.0.4.",
                "content": {TEXT: {"schema": {"type": "string"}}},
            },
            **_errors((413, 500)),
        },
        ("/start_profile", "post"): {
            "200": _json_ok(ProfileStatus, "The profiler started; the trace directory."),
            **profile_errors,
        },
        ("/stop_profile", "post"): {
            "200": _json_ok(ProfileStatus, "The profiler stopped and wrote its trace there."),
            **profile_errors,
        },
    }


# FastAPI's schemas of its 422 body, which this server never sends.
_UNUSED_SCHEMAS = ("HTTPValidationError", "ValidationError")


def build_openapi(app: FastAPI) -> dict[str, Any]:
    """`app`'s OpenAPI document with the responses the server sends."""
    document = get_openapi(
        title=app.title,
        version=app.version,
        openapi_version=app.openapi_version,
        description=app.description,
        routes=app.routes,
    )
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for name in _UNUSED_SCHEMAS:
        schemas.pop(name, None)
    _, definitions = models_json_schema(
        [(model, "serialization") for model in _RESPONSE_MODELS], ref_template=_REF
    )
    schemas.update(definitions["$defs"])
    state = getattr(app.state, "atom", None)  # the ServerState of an app from build_app
    if state is not None:
        for name, fields in request_bounds(state).items():
            properties = schemas.get(name, {}).get("properties", {})
            for field_name, by_type in fields.items():
                if field_name in properties:
                    bound(properties[field_name], by_type)
    known = _responses()
    for path, item in document.get("paths", {}).items():
        for method, operation in item.items():
            responses = known.get((path, method))
            if responses is None:  # a route added without documenting it here: the generic
                responses = {
                    key: value for key, value in operation["responses"].items() if key != "422"
                }
                statuses = (400, 413, 500) if "requestBody" in operation else (413, 500)
                responses.update(_errors(statuses))
            operation["responses"] = responses
    return document


def install_openapi(app: FastAPI) -> None:
    """Make `app.openapi()` (served as `/openapi.json`) describe what the server answers."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi
