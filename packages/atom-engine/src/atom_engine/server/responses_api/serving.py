"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: `register` adds them to the
server's /v1 router. A request runs as the chat request it asks for (`convert`,
`serving_chat.chat_engine_prompt`), one engine request watched for disconnects like chat's; its
reply is cut into output items (`convert.output_items`) or streamed as events (`stream`). A response
with `store` (the default) is kept in the bounded `ResponseStore` once it has finished.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from atom_engine.outputs import RequestOutput
from atom_engine.server.chat_output import ChatOutput
from atom_engine.server.reasoning import REASONING_PARSERS
from atom_engine.server.responses_api.convert import (
    assistant_message,
    chat_request,
    input_messages,
    output_items,
    refuse_unsupported,
    rename_error,
)
from atom_engine.server.responses_api.objects import (
    DeletedResponse,
    ErrorEvent,
    IncompleteDetails,
    ResponseError,
    ResponseObject,
    ResponseUsage,
    new_id,
)
from atom_engine.server.responses_api.protocol import ResponsesRequest
from atom_engine.server.responses_api.store import ResponseStore, StoredResponse
from atom_engine.server.responses_api.stream import EventWriter
from atom_engine.server.serving_chat import chat_engine_prompt
from atom_engine.server.serving_common import APIError, RequestGroup, ServerState
from atom_engine.server.structured import ToolPlan
from atom_engine.server.tool_parsers import TOOL_PARSERS


def register(router: APIRouter, state: ServerState, store: ResponseStore) -> None:
    """Add the Responses routes to `router` (the app's /v1 router)."""

    @router.post("/responses")
    async def create_response_route(request: ResponsesRequest, raw_request: Request):
        return await create_response(state, store, request, raw_request)

    @router.get("/responses/{response_id}")
    async def retrieve_response(response_id: str) -> ResponseObject:
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id, "response_id")
        return entry.response

    @router.delete("/responses/{response_id}")
    async def delete_response(response_id: str) -> DeletedResponse:
        if not store.delete(response_id):
            raise _not_found(response_id, "response_id")
        return DeletedResponse(id=response_id)


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(
        f"Response with id '{response_id}' not found: it was not stored (store: false), was "
        "deleted, or was dropped from the server's store (--responses-store-size)",
        status=404,
        param=param,
    )


def _skeleton(state: ServerState, request: ResponsesRequest, response_id: str) -> ResponseObject:
    """The response object before its output: the request's settings, as OpenAI echoes them."""
    fmt = request.text.format if request.text is not None else None
    effort = request.reasoning.effort if request.reasoning is not None else None
    tool_choice = request.tool_choice or ("auto" if request.tools else "none")
    return ResponseObject(
        id=response_id,
        status="in_progress",
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        model=state.served_model_name,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        previous_response_id=request.previous_response_id,
        reasoning={"effort": effort, "summary": None},
        store=request.store,
        temperature=1.0 if request.temperature is None else request.temperature,
        text={
            "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
        },
        tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        tools=[t.model_dump() for t in request.tools or []],
        top_p=1.0 if request.top_p is None else request.top_p,
        user=request.user,
        metadata=request.metadata or {},
    )


def _finish(response: ResponseObject, output: RequestOutput | None) -> None:
    """Status and usage of a finished response."""
    assert output is not None and output.finished
    completion = output.outputs[0]
    if completion.finish_reason == "length":
        response.status = "incomplete"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
    else:
        response.status = "completed"
    num_input, num_output = len(output.prompt_token_ids), len(completion.token_ids)
    response.usage = ResponseUsage(
        input_tokens=num_input, output_tokens=num_output, total_tokens=num_input + num_output
    )


async def create_response(
    state: ServerState, store: ResponseStore, request: ResponsesRequest, raw_request: Request
):
    state.check_model(request.model)
    refuse_unsupported(request)
    history: list[dict] = []
    if request.previous_response_id is not None:
        previous = store.get(request.previous_response_id)
        if previous is None:
            raise _not_found(request.previous_response_id, "previous_response_id")
        history = previous.messages
    conversation = [*history, *input_messages(request)]
    if not conversation:
        raise APIError("input holds no message (nor function call output)", param="input")
    try:
        engine_prompt, plan = await chat_engine_prompt(state, chat_request(request, conversation))
    except APIError as e:
        raise rename_error(e) from None
    response_id = new_id("resp")
    group = await RequestGroup.start(state, raw_request, response_id, [engine_prompt])
    response = _skeleton(state, request, response_id)
    reply = _chat_output(state, plan)

    def keep() -> None:
        if request.store:
            messages = [*conversation, assistant_message(response.output)]
            store.put(StoredResponse(response.model_copy(deep=True), messages))

    if request.stream:
        return StreamingResponse(
            _events(group, response, reply, keep), media_type="text/event-stream"
        )
    final = None
    try:
        async for _, output in group.outputs():
            final = output
    finally:
        group.close()
    _finish(response, final)
    text = final.outputs[0].text
    response.output = output_items(reply.message(text), _item_status(response))
    keep()
    return JSONResponse(response.model_dump())


def _chat_output(state: ServerState, plan: ToolPlan) -> ChatOutput:
    reasoning = REASONING_PARSERS[state.reasoning_parser]() if state.reasoning_parser else None
    tools = TOOL_PARSERS[state.tool_parser]() if plan.mode == "auto" else None
    return ChatOutput(plan, tools, reasoning)


def _item_status(response: ResponseObject) -> str:
    return "incomplete" if response.status == "incomplete" else "completed"


async def _events(
    group: RequestGroup, response: ResponseObject, reply: ChatOutput, keep
) -> AsyncIterator[str]:
    writer = EventWriter()
    try:
        yield writer.lifecycle("response.created", response)
        yield writer.lifecycle("response.in_progress", response)
        async for _, output in group.outputs():
            completion = output.outputs[0]
            finished = completion.finish_reason is not None
            delta = reply.delta(completion.text, finished)
            if not finished:
                for event in writer.delta(delta) if delta is not None else []:
                    yield event
                continue
            _finish(response, output)
            for event in writer.finish(delta, _item_status(response)):
                yield event
        response.output = writer.items
        keep()
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield writer.lifecycle(kind, response)
    except APIError as e:
        if e.status == 499:
            return  # the client is gone
        yield writer.error(ErrorEvent(code=e.type, message=e.message, param=e.param))
        yield _failed(writer, response, e.type, e.message)
    except Exception as e:
        error = ErrorEvent(code="InternalServerError", message=f"{type(e).__name__}: {e}")
        yield writer.error(error)
        yield _failed(writer, response, error.code, error.message)
    finally:
        group.close()


def _failed(writer: EventWriter, response: ResponseObject, code: str, message: str) -> str:
    """The `response.failed` event that ends a stream whose request failed (after `error`)."""
    response.status = "failed"
    response.error = ResponseError(code=code, message=message)
    return writer.lifecycle("response.failed", response)
