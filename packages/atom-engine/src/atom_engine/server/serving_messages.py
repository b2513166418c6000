"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat path.

The request becomes a chat completion request (`messages_convert`), runs as one
(`serving_chat.chat_engine_prompt`: chat template, sampling, tools), and its output is split by
the same `ChatOutput` (reasoning parser, tool-call parser) into Anthropic content blocks:
`thinking`, `text`, `tool_use`. A stream sends Anthropic's events (`message_start`, `ping`,
`content_block_start` / `_delta` / `_stop` per block, `message_delta` with the stop reason and
usage, `message_stop`), and `event: error` when the request fails once streaming. Errors on
these routes have Anthropic's shape (`anthropic_protocol.anthropic_error`; api_server picks the
shape by path). A client that disconnects aborts its request (`RequestGroup`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.requests import Request

from atom_engine.chat_template import apply_chat_template
from atom_engine.outputs import CompletionOutput, RequestOutput
from atom_engine.server.anthropic_protocol import (
    AnthropicErrorResponse,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    CountTokensResponse,
    DeltaUsage,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessagesRequest,
    MessagesResponse,
    MessageStartEvent,
    MessageStopEvent,
    MessagesUsage,
    PingEvent,
    ResponseBlock,
    ResponseTextBlock,
    ResponseThinkingBlock,
    ResponseToolUseBlock,
    TextDelta,
    ThinkingDelta,
    anthropic_error,
    anthropic_id,
)
from atom_engine.server.chat_output import ChatOutput
from atom_engine.server.messages_convert import anthropic_names, to_chat_request
from atom_engine.server.reasoning import END as REASONING_END
from atom_engine.server.reasoning import REASONING_PARSERS
from atom_engine.server.reasoning import START as REASONING_START
from atom_engine.server.serving_chat import chat_engine_prompt, chat_messages
from atom_engine.server.serving_common import APIError, RequestGroup, ServerState
from atom_engine.server.structured import ToolPlan
from atom_engine.server.tool_parsers import TOOL_PARSERS


def register_messages(router: APIRouter, state: ServerState) -> None:
    """Add the Messages routes to `router` (the /v1 router, behind the API key check)."""

    @router.post("/messages")
    async def messages(request: MessagesRequest, raw_request: Request):
        return await create_message(state, request, raw_request)

    @router.post("/messages/count_tokens")
    async def messages_count_tokens(request: CountTokensRequest) -> CountTokensResponse:
        return await count_tokens(state, request)


def _tool_input(arguments: str) -> dict:
    value = json.loads(arguments)  # the parsers hand over JSON objects
    return value if isinstance(value, dict) else {}


def _stop(completion: CompletionOutput, parts: ChatOutput) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished completion."""
    if parts.has_tool_calls:
        return "tool_use", None
    if completion.finish_reason == "length":
        return "max_tokens", None
    if isinstance(completion.stop_reason, str):
        return "stop_sequence", completion.stop_reason
    return "end_turn", None


async def create_message(state: ServerState, request: MessagesRequest, raw_request: Request):
    try:
        chat = to_chat_request(state, request)
        engine_prompt, plan = await chat_engine_prompt(state, chat)
        _set_thinking_budget(state, request, engine_prompt[1])
    except APIError as e:
        raise anthropic_names(e) from None
    message_id = anthropic_id("msg")
    group = await RequestGroup.start(state, raw_request, message_id, [engine_prompt])
    stream = _MessageStream(state, group, message_id, plan)
    if request.stream:
        num_prompt = len(engine_prompt[0]["prompt_token_ids"])
        return StreamingResponse(stream.events(num_prompt), media_type="text/event-stream")
    final = None
    try:
        async for _, output in group.outputs():
            final = output
    finally:
        group.close()
    return JSONResponse(stream.response(final).model_dump())


def _set_thinking_budget(state: ServerState, request: MessagesRequest, params) -> None:
    """`thinking.budget_tokens` as the sampler's thinking budget: the reasoning parser's end
    marker is forced once that many tokens are out (`to_chat_request` checked the fields)."""
    thinking = request.thinking
    if thinking is None or thinking.type != "enabled" or thinking.budget_tokens is None:
        return
    tokenizer = state.engine.tokenizer
    params.thinking_budget = thinking.budget_tokens
    params.thinking_end_ids = tokenizer.encode(REASONING_END, add_special_tokens=False)
    if not REASONING_PARSERS[state.reasoning_parser].implicit_start:
        # The reply reasons only when it opens with <think> (qwen3): close only such a reply.
        params.thinking_start_ids = tokenizer.encode(REASONING_START, add_special_tokens=False)


async def count_tokens(state: ServerState, request: CountTokensRequest) -> CountTokensResponse:
    """The prompt's token count, as /v1/messages renders the same messages, system and tools."""
    try:
        chat = to_chat_request(state, request)
        state.check_model(chat.model)
    except APIError as e:
        raise anthropic_names(e) from None
    if state.engine.tokenizer is None:
        raise APIError("the server runs without a tokenizer: it cannot count tokens")
    messages = chat_messages(chat.messages)
    tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
    preprocessor = state.preprocessor

    def count() -> int:
        token_ids = apply_chat_template(
            preprocessor.tokenizer,
            messages,
            chat_template_kwargs=chat.chat_template_kwargs,
            max_chars=preprocessor.max_prompt_chars,
            tools=tools or None,
        )
        return len(token_ids)

    try:
        return CountTokensResponse(input_tokens=await preprocessor.run(count))
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def _event(event: BaseModel) -> str:
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"


class _MessageStream:
    """Builds the response, or the stream events, of one messages request."""

    def __init__(
        self, state: ServerState, group: RequestGroup, message_id: str, plan: ToolPlan
    ) -> None:
        self.state, self.group, self.id = state, group, message_id
        reasoning = REASONING_PARSERS[state.reasoning_parser]() if state.reasoning_parser else None
        tools = TOOL_PARSERS[state.tool_parser]() if plan.mode == "auto" else None
        self.parts = ChatOutput(plan, tools, reasoning)
        self.index, self.kind = -1, None  # the open block of a stream

    def _message(self, content: list, stop: tuple, usage: MessagesUsage) -> MessagesResponse:
        return MessagesResponse(
            id=self.id,
            model=self.state.served_model_name,
            content=content,
            stop_reason=stop[0],
            stop_sequence=stop[1],
            usage=usage,
        )

    def response(self, output: RequestOutput | None) -> MessagesResponse:
        assert output is not None and output.finished
        completion = output.outputs[0]
        message = self.parts.message(completion.text)
        content: list[ResponseBlock] = []
        if message.reasoning_content:
            content.append(ResponseThinkingBlock(thinking=message.reasoning_content))
        if message.content:
            content.append(ResponseTextBlock(text=message.content))
        for call in message.tool_calls:
            content.append(
                ResponseToolUseBlock(
                    id=anthropic_id("toolu"),
                    name=call.function.name,
                    input=_tool_input(call.function.arguments),
                )
            )
        usage = MessagesUsage(
            input_tokens=len(output.prompt_token_ids), output_tokens=len(completion.token_ids)
        )
        return self._message(content, _stop(completion, self.parts), usage)

    # -- streaming -----------------------------------------------------------------------------

    def _close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event(ContentBlockStopEvent(index=self.index))]

    def _open(self, kind: str, block: ResponseBlock) -> list[str]:
        events = self._close()
        self.index, self.kind = self.index + 1, kind
        return [*events, _event(ContentBlockStartEvent(index=self.index, content_block=block))]

    def _text(self, kind: str, text: str) -> list[str]:
        events = []
        if kind != self.kind:
            empty = ResponseThinkingBlock(thinking="") if kind == "thinking" else None
            events = self._open(kind, empty or ResponseTextBlock(text=""))
        delta = ThinkingDelta(thinking=text) if kind == "thinking" else TextDelta(text=text)
        return [*events, _event(ContentBlockDeltaEvent(index=self.index, delta=delta))]

    def _tool_use(self, name: str, arguments: str) -> list[str]:
        block = ResponseToolUseBlock(id=anthropic_id("toolu"), name=name, input={})
        events = self._open("tool_use", block)
        delta = InputJsonDelta(partial_json=json.dumps(_tool_input(arguments)))
        events.append(_event(ContentBlockDeltaEvent(index=self.index, delta=delta)))
        return [*events, *self._close()]

    async def events(self, num_prompt: int) -> AsyncIterator[str]:
        usage = MessagesUsage(input_tokens=num_prompt, output_tokens=0)
        start = self._message([], (None, None), usage)
        yield _event(MessageStartEvent(message=start))
        yield _event(PingEvent())
        try:
            async for _, output in self.group.outputs():
                completion = output.outputs[0]
                finished = completion.finish_reason is not None
                delta = self.parts.delta(completion.text, finished)
                events = []
                if delta is not None:
                    if delta.reasoning_content:
                        events += self._text("thinking", delta.reasoning_content)
                    if delta.content:
                        events += self._text("text", delta.content)
                    for call in delta.tool_calls or []:
                        events += self._tool_use(call.function.name, call.function.arguments)
                if finished:
                    events += self._close()
                    stop_reason, stop_sequence = _stop(completion, self.parts)
                    events.append(
                        _event(
                            MessageDeltaEvent(
                                delta=MessageDelta(
                                    stop_reason=stop_reason, stop_sequence=stop_sequence
                                ),
                                usage=DeltaUsage(output_tokens=len(completion.token_ids)),
                            )
                        )
                    )
                    events.append(_event(MessageStopEvent()))
                for event in events:
                    yield event
        except APIError as e:
            if e.status == 499:
                return  # the client is gone
            yield _error_event(e.status, e.message)
        except Exception as e:
            yield _error_event(500, f"{type(e).__name__}: {e}")
        finally:
            self.group.close()


def _error_event(status: int, message: str) -> str:
    body = AnthropicErrorResponse.model_validate(anthropic_error(status, message))
    return f"event: error\ndata: {body.model_dump_json()}\n\n"
