"""Requests' structured-output and tool fields -> the engine's `StructuredOutputsParams`.

`response_format` (OpenAI: json_schema, json_object, text) and `structured_outputs` (vLLM: json,
regex, choice, grammar, json_object) set the grammar of a completion or chat request; a chat
request's `tools` with `tool_choice` "required" or a named function set it too (the calls as
JSON, so their arguments always parse and validate). Only one of them may constrain a request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from atom_engine.sampling_params import StructuredOutputsParams
from atom_engine.server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    NamedToolChoice,
    SamplingRequest,
)
from atom_engine.server.serving_common import APIError

# A function without `parameters` takes none.
_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a chat request's tools ask for. `mode`: "none" (no tools, or tool_choice none: a
    plain reply), "auto" (the model may call: parsed from its text), "required" (a JSON list of
    {"name", "parameters"}), "named" (the JSON arguments of `name`)."""

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)  # as the chat template gets them
    name: str | None = None
    spec: StructuredOutputsParams | None = None


def _parameters(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters or _NO_PARAMETERS


def tool_plan(request: ChatCompletionRequest, tool_parser: str | None) -> ToolPlan:
    """The request's ToolPlan; a 400 naming tools / tool_choice when they do not fit."""
    tools = request.tools or []
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice not in ("none", "auto"):
            raise APIError("tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError("tools must have distinct function names", param="tools")
    template_tools = [t.model_dump(exclude_none=True) for t in tools]
    if choice == "none":
        return ToolPlan("none", template_tools)
    if choice == "auto":
        if tool_parser is None:
            raise APIError(
                'tool_choice "auto" needs a tool-call parser for the model\'s format: start the '
                "server with --tool-call-parser (hermes, llama3_json, deepseek_v3)",
                param="tool_choice",
            )
        return ToolPlan("auto", template_tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise APIError(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        schema = _parameters(tools[names.index(name)])
        return ToolPlan("named", template_tools, name, StructuredOutputsParams(json=schema))
    # "required": a list of calls, each one of the tools with its parameters.
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t.function.name]},
                        "parameters": _parameters(t),
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ]
        },
    }
    if request.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolPlan("required", template_tools, spec=StructuredOutputsParams(json=calls))


def structured_spec(
    request: SamplingRequest, plan: ToolPlan | None = None
) -> tuple[StructuredOutputsParams | None, str | None]:
    """(the request's grammar spec, the request field it comes from); a 400 naming the field
    when it is malformed or two fields ask for a grammar."""
    sources = []
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        sources.append("response_format")
    if request.structured_outputs is not None:
        sources.append("structured_outputs")
    if plan is not None and plan.spec is not None:
        sources.append("tool_choice")
    if len(sources) > 1:
        raise APIError(
            f"only one of {' and '.join(sources)} may constrain the output", param=sources[-1]
        )
    if not sources:
        return None, None
    source = sources[0]
    if source == "tool_choice":
        return plan.spec, "tools"
    try:
        if source == "response_format":
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True), source
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(
                    'response_format of type "json_schema" needs json_schema.schema',
                    param="response_format",
                )
            return StructuredOutputsParams(json=fmt.json_schema.schema_), source
        so = request.structured_outputs
        return (
            StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=so.choice,
                grammar=so.grammar,
                json_object=so.json_object,
            ),
            source,
        )
    except ValueError as e:
        message = str(e).replace("SamplingParams.structured_outputs", source)
        raise APIError(message, param=source) from None
