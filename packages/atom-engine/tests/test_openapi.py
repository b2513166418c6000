"""The OpenAPI document describes the server: its routes' responses by hand, and schemathesis
against a live server (generated requests, valid and invalid, checked for 5xx and for status
codes, content types and bodies that the document does not describe).

The schemathesis run serves the bundled SmolLM2 (float32, CPU) with a 96-token context and at
most 4 sequences in a batch, so that no generated request costs more than ~96 decode steps.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import pytest

from atom_engine import EngineConfig
from atom_engine.server.api_server import build_app
from atom_engine.server.async_engine import AsyncEngine
from atom_engine.server.openapi import build_openapi
from atom_engine.testing import http, serve, wait_idle

MODEL = "smollm2-test"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    config = EngineConfig(
        dtype="float32",
        device="cpu",
        max_model_len=96,
        max_num_seqs=4,
        max_num_batched_tokens=96,
        cpu_kv_cache_space=0.05,
    )
    engine = AsyncEngine.from_config(config)
    profiler_dir = tmp_path_factory.mktemp("profile")
    server = serve(build_app(engine, MODEL, None, profiler_dir=str(profiler_dir)), engine)
    yield server
    server.stop()
    engine.shutdown()


# -- the document -----------------------------------------------------------------------------


def test_document_has_no_fastapi_defaults(server):
    document = http("GET", server.url + "/openapi.json").json()
    assert document == build_openapi(server.uvicorn.config.app)
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    anthropic_error = {"$ref": "#/components/schemas/AnthropicErrorResponse"}
    for path, item in document["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            assert "422" not in responses, (path, method)
            body = anthropic_error if path.startswith("/v1/messages") else error
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    assert response["content"] == {"application/json": {"schema": body}}
    paths = document["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        responses = paths[path]["post"]["responses"]
        assert set(responses) == {"200", "400", "401", "404", "413", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    messages = paths["/v1/messages"]["post"]["responses"]
    assert set(messages) == {"200", "400", "401", "404", "413", "500", "503"}
    assert set(messages["200"]["content"]) == {"application/json", "text/event-stream"}
    count = paths["/v1/messages/count_tokens"]["post"]["responses"]
    assert count["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CountTokensResponse"
    }
    assert "content" not in paths["/health"]["get"]["responses"]["200"]
    assert set(paths["/health"]["get"]["responses"]) == {"200", "413", "500", "503"}
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert paths["/version"]["get"]["responses"]["200"]["content"]["application/json"]
    # The request schemas carry the served model's ranges.
    completion = schemas["CompletionRequest"]["properties"]
    n = completion["n"]["anyOf"][0]  # null: the default 1
    assert n["maximum"] == 4 and n["minimum"] == 1
    assert completion["top_p"]["anyOf"][0] == {
        "type": "number",
        "exclusiveMinimum": 0,
        "maximum": 1,
    }
    vocab = server.engine.engine.vocab_size
    assert completion["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == vocab - 1


def _sse_response(text: str):
    import requests
    import schemathesis

    request = requests.Request("POST", "http://x/v1/completions", data=b"{}").prepare()
    return schemathesis.Response(
        status_code=200,
        headers={"content-type": ["text/event-stream; charset=utf-8"]},
        content=text.encode(),
        request=request,
        elapsed=0.0,
        verify=True,
        message="OK",
        encoding="utf-8",
        http_version="1.1",
    )


def test_event_stream_events_are_checked(server):
    """schemathesis reads the `text/event-stream` schema as one event's: chunks, error events
    and [DONE] pass; anything else fails (so the live run below does check streams)."""
    import schemathesis
    from schemathesis.core.failures import FailureGroup
    from schemathesis.specs.openapi.checks import response_schema_conformance

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    case = schema["/v1/completions"]["POST"].Case(body={"prompt": "hi", "stream": True})
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": MODEL,
             "choices": [{"index": 0, "text": "x"}]}  # fmt: skip
    error = {"error": {"message": "m", "type": "InternalServerError", "param": None, "code": 500}}
    good = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n"
    case.validate_response(_sse_response(good), checks=[response_schema_conformance])
    for bad in ('{"id": "c", "choices": "x"}', "[DONE", '{"error": {"message": 5}}'):
        with pytest.raises(FailureGroup):
            response = _sse_response(f"data: {bad}\n\ndata: [DONE]\n\n")
            case.validate_response(response, checks=[response_schema_conformance])


# -- schemathesis -----------------------------------------------------------------------------

# Generated requests per operation and mode; the generation endpoints get more. Measured on the
# 2-core CPU: 25 each, ~120 s of requests (~160 s with loading the model); 80 each took 480 s.
# /v1/messages and /v1/responses run the chat path: half as many each (with /v1/messages alone,
# 215 s of requests at load ~3.5; with /v1/responses alone at 25, 213 s).
_NUM = int(os.environ.get("ATOM_SCHEMATHESIS_EXAMPLES", "25"))
EXAMPLES = {
    "/v1/completions": _NUM,
    "/v1/chat/completions": _NUM,
    "/v1/messages": _NUM // 2,
    "/v1/responses": _NUM // 2,
}
OTHER_EXAMPLES = 8


# Requests that succeed, in every response shape the server has: generated requests rarely do
# (a random value of a field is mostly out of its range), so these are sent too, each checked
# like a generated one.
_CHAT = [{"role": "user", "content": "Name a color."}]
VALID = {
    "/v1/completions": [
        {"prompt": "The capital of France is", "max_tokens": 3},
        {"prompt": ["1, 2,", "a, b,"], "max_tokens": 2, "n": 2, "temperature": 1.0, "seed": 1},
        {"prompt": [1, 2, 3], "max_tokens": 2, "logprobs": 2, "echo": True, "prompt_logprobs": 2},
        {"prompt": "hi", "max_tokens": 0, "echo": True, "logprobs": 1},
        {"prompt": "hi", "max_tokens": 4, "stop": [" "], "include_stop_str_in_output": True},
        {"prompt": "hi", "max_tokens": 3, "stream": True, "logprobs": 1, "echo": True,
         "stream_options": {"include_usage": True}},
        {"prompt": ["a", "b"], "max_tokens": 2, "n": 2, "stream": True, "seed": 3},
    ],
    "/v1/chat/completions": [
        {"messages": _CHAT, "max_tokens": 3},
        {"messages": _CHAT, "max_completion_tokens": 2, "logprobs": True, "top_logprobs": 2,
         "n": 2, "seed": 5, "prompt_logprobs": 1},
        {"messages": _CHAT, "max_tokens": 3, "stream": True, "logprobs": True,
         "stream_options": {"include_usage": True}},
        {"messages": _CHAT, "max_tokens": 2, "n": 2, "stream": True, "stop": ["e"]},
    ],
    "/v1/messages": [
        {"model": MODEL, "messages": _CHAT, "max_tokens": 3, "system": "Be brief.",
         "stop_sequences": ["e"], "temperature": 0.5, "top_k": 5},
        {"model": MODEL, "messages": _CHAT, "max_tokens": 3, "stream": True},
        {"model": MODEL, "max_tokens": 30, "stream": True,
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]}],
         "tools": [{"name": "w", "input_schema": {"type": "object", "properties": {
             "c": {"type": "string", "enum": ["a", "b"]}}, "required": ["c"]}}],
         "tool_choice": {"type": "any"}},
    ],
    "/v1/messages/count_tokens": [{"model": MODEL, "messages": _CHAT, "system": "Be brief."}],
    "/v1/responses": [
        {"input": "Name a color.", "max_output_tokens": 3, "instructions": "Be brief."},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
         "max_output_tokens": 3, "stream": True, "store": False},
        {"input": "Weather?", "max_output_tokens": 24, "tool_choice": "required",
         "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]},
        {"input": "JSON:", "max_output_tokens": 8, "stream": True,
         "text": {"format": {"type": "json_object"}}},
    ],
    "/tokenize": [
        {"prompt": "hi", "return_token_strs": True},
        {"messages": _CHAT, "add_special_tokens": True},
    ],
    "/detokenize": [{"tokens": [1, 2, 3]}],
}  # fmt: skip


def _checks():
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        negative_data_rejection,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    conformance = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    return {"positive": conformance, "negative": [*conformance, negative_data_rejection]}


def _fuzz(operation, mode, examples: int, session, checks, failures: dict, counts: dict) -> None:
    """Send `examples` generated requests of one operation and mode; record each kind of
    failure once (its report)."""
    from hypothesis import HealthCheck, Phase, given, seed, settings
    from schemathesis.core.failures import FailureGroup

    @seed(int(os.environ.get("ATOM_SCHEMATHESIS_SEED", "0")))
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case):
        try:
            response = case.call_and_validate(session=session, checks=checks, timeout=300)
            status = response.status_code
        except FailureGroup as group:
            for failure in group.exceptions:
                key = f"{operation.label} [{mode.value}] {type(failure).__name__}"
                failures.setdefault(key, str(group))
            status = "failed"
        key = f"{operation.label} [{mode.value}]"
        counts.setdefault(key, Counter())[status] += 1

    run()


def _send_valid(operation, session, checks, failures: dict, counts: dict) -> None:
    from schemathesis.core.failures import FailureGroup

    for body in VALID.get(operation.path, []):
        case = operation.Case(body=body, media_type="application/json")
        try:
            status = case.call_and_validate(session=session, checks=checks, timeout=300).status_code
        except FailureGroup as group:
            for failure in group.exceptions:
                key = f"{operation.label} [valid] {type(failure).__name__}"
                failures.setdefault(key, str(group))
            status = "failed"
        counts.setdefault(f"{operation.label} [valid]", Counter())[status] += 1


@pytest.mark.slow
def test_schemathesis(server, capsys):
    """Every operation gets generated requests, valid and invalid by the document; each answer
    must be no 5xx and conform to the document (status, content type, headers, body), and an
    invalid request must be refused with a 4xx. All failures are collected, then reported."""
    import requests
    import schemathesis

    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    checks = _checks()
    session = requests.Session()
    failures: dict[str, str] = {}
    counts: dict[str, Counter] = {}
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        _send_valid(operation, session, checks["positive"], failures, counts)
        examples = EXAMPLES.get(operation.path, OTHER_EXAMPLES)
        modes = [schemathesis.GenerationMode.POSITIVE]
        if len(operation.body):  # nothing to make invalid in a request without a body
            modes.append(schemathesis.GenerationMode.NEGATIVE)
        for mode in modes:
            _fuzz(operation, mode, examples, session, checks[mode.value], failures, counts)
    wait_idle(server.engine)
    lines = [f"schemathesis: {time.monotonic() - started:.0f} s, statuses by operation and mode"]
    lines += [f"  {key}: {dict(statuses)}" for key, statuses in counts.items()]
    lines += [f"--- {key}\n{report[:3000]}" for key, report in failures.items()]
    with capsys.disabled():  # shown whether or not pytest captures output
        print("\n" + "\n".join(lines))
    assert not failures, list(failures)
