"""POST /v1/chat/completions: messages (and tools) through the model's chat template, replies
out: content, reasoning_content and tool_calls (`chat_output`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from atom_engine.chat_template import message_text, template_reads
from atom_engine.outputs import CompletionOutput, RequestOutput
from atom_engine.sampling_params import SamplingParams
from atom_engine.server.chat_output import ChatOutput
from atom_engine.server.logprobs import chat_logprobs, prompt_logprobs_json
from atom_engine.server.protocol import ChatCompletionRequest, ChatMessage, random_id
from atom_engine.server.reasoning import REASONING_PARSERS
from atom_engine.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from atom_engine.server.serving_common import (
    SSE_DONE,
    APIError,
    RequestGroup,
    ServerState,
    error_json,
    finish_reason,
    sampling_params,
    sse,
    value_error,
)
from atom_engine.server.structured import ToolPlan, structured_spec, tool_plan
from atom_engine.server.tool_parsers import TOOL_PARSERS


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    if request.stream and request.prompt_logprobs is not None:
        raise APIError(
            "prompt_logprobs is only returned by non-streaming chat completions",
            param="prompt_logprobs",
        )
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError("top_logprobs needs logprobs to be true", param="top_logprobs")
    if request.functions:
        raise APIError(
            "functions (deprecated) is not supported: send the functions as tools, "
            '[{"type": "function", "function": ...}]',
            param="functions",
        )
    if request.function_call is not None:
        raise APIError(
            "function_call (deprecated) is not supported: use tools and tool_choice",
            param="function_call",
        )
    if request.prediction is not None:
        raise APIError(
            "predicted outputs (prediction) are not supported; leave the field out",
            param="prediction",
        )


def _template_kwargs(state: ServerState, request: ChatCompletionRequest) -> dict | None:
    """chat_template_kwargs, with reasoning_effort for a template that reads it (a 400 for one
    that does not: the effort would be ignored)."""
    kwargs = request.chat_template_kwargs
    effort = request.reasoning_effort
    if effort is None:
        return kwargs
    if not template_reads(state.engine.tokenizer, request.chat_template, "reasoning_effort"):
        raise APIError(
            "reasoning_effort is not supported by this model: its chat template does not read it",
            param="reasoning_effort",
        )
    if (kwargs or {}).get("reasoning_effort", effort) != effort:
        raise APIError(
            "reasoning_effort and chat_template_kwargs.reasoning_effort differ",
            param="reasoning_effort",
        )
    return {**(kwargs or {}), "reasoning_effort": effort}


def chat_messages(messages: list[ChatMessage]) -> list[dict]:
    """The request's messages as the chat template gets them; a 400 naming messages."""
    try:
        result = []
        for message in messages:
            entry = message.model_dump(exclude_none=True)
            entry["content"] = message_text(message.content)
            _parse_tool_call_arguments(entry)
            result.append(entry)
        return result
    except ValueError as e:
        raise APIError(str(e), param="messages") from None


def _parse_tool_call_arguments(message: dict) -> None:
    """An assistant message's tool calls carry their arguments as JSON text (OpenAI); chat
    templates (Qwen's, Llama's, ...) format them as objects, as vLLM hands them over."""
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text


async def prepare_chat(
    state: ServerState, request: ChatCompletionRequest
) -> tuple[tuple[dict, SamplingParams], ToolPlan]:
    """The checked engine prompt of a chat request (rendered by the chat template, with its
    sampling params and grammar) and its tool plan; a 400 naming the field at fault. The
    Responses API (`responses_api`) runs its requests through here too."""
    _refuse_unsupported(request)
    # Field names as a chat request spells them (the prompt is its messages).
    max_tokens, names = request.max_tokens, {"logprobs": "top_logprobs", "prompt": "messages"}
    if request.max_completion_tokens is not None:
        max_tokens, names["max_tokens"] = request.max_completion_tokens, "max_completion_tokens"
    num_top = request.top_logprobs or 0
    plan = tool_plan(request, state.tool_parser)
    spec, names["structured_outputs"] = structured_spec(request, plan)
    params = sampling_params(
        request,
        state.max_n,
        max_tokens,
        logprobs=num_top if request.logprobs else None,
        param_names=names,
        structured_outputs=spec,
    )
    if plan.mode == "auto":
        params.skip_special_tokens = False  # tool-call markers may be special tokens
    template_kwargs = _template_kwargs(state, request)
    preprocessor = state.preprocessor
    try:
        engine_prompt = await preprocessor.run(
            preprocessor.chat_prompt,
            chat_messages(request.messages),
            params,
            request.add_generation_prompt,
            request.continue_final_message,
            request.chat_template,
            template_kwargs,
            plan.tools,
        )
    except ValueError as e:
        raise value_error(e, "messages", names) from None
    return engine_prompt, plan


async def create_chat_completion(
    state: ServerState, request: ChatCompletionRequest, raw_request: Request
):
    state.check_model(request.model)
    engine_prompt, plan = await prepare_chat(state, request)
    chat_id = random_id("chatcmpl")
    group = await RequestGroup.start(state, raw_request, chat_id, [engine_prompt])
    stream = _ChatStream(state, request, group, chat_id, plan)
    if request.stream:
        return StreamingResponse(stream.events(), media_type="text/event-stream")
    final = None
    try:
        async for _, output in group.outputs():
            final = output
    finally:
        group.close()
    return JSONResponse(stream.response(final).model_dump())


class _ChatStream:
    """Builds the response, or the SSE chunks, of one chat request."""

    def __init__(
        self,
        state: ServerState,
        request: ChatCompletionRequest,
        group: RequestGroup,
        rid: str,
        plan: ToolPlan,
    ) -> None:
        self.state, self.request, self.group, self.id = state, request, group, rid
        self.tokenizer = state.engine.tokenizer
        self.created = int(time.time())
        self.num_top = request.top_logprobs or 0
        reasoning = REASONING_PARSERS[state.reasoning_parser]() if state.reasoning_parser else None
        tools = TOOL_PARSERS[state.tool_parser]() if plan.mode == "auto" else None
        self.outputs = [ChatOutput(plan, tools, reasoning) for _ in range(request.n)]

    def _logprobs(self, completion: CompletionOutput, start: int) -> ChatLogProbs | None:
        if not self.request.logprobs:
            return None
        content = chat_logprobs(
            completion.token_ids[start:],
            (completion.logprobs or [])[start:],
            self.num_top,
            self.tokenizer,
        )
        return ChatLogProbs(content=content)

    @staticmethod
    def _usage(output: RequestOutput) -> UsageInfo:
        prompt = len(output.prompt_token_ids)
        completion = sum(len(c.token_ids) for c in output.outputs)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def response(self, output: RequestOutput | None) -> ChatCompletionResponse:
        assert output is not None and output.finished
        choices = []
        for completion in output.outputs:
            parts = self.outputs[completion.index]
            choices.append(
                ChatChoice(
                    index=completion.index,
                    message=parts.message(completion.text),
                    logprobs=self._logprobs(completion, 0),
                    finish_reason=parts.finish_reason(finish_reason(completion.finish_reason)),
                    stop_reason=completion.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.state.served_model_name,
            choices=choices,
            usage=self._usage(output),
            prompt_logprobs=(
                None
                if self.request.prompt_logprobs is None
                else prompt_logprobs_json(output.prompt_logprobs)
            ),
        )

    def _chunk(self, choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.state.served_model_name,
            choices=choices,
            usage=usage,
        )
        return sse(chunk.model_dump_json(exclude_none=True))

    async def events(self) -> AsyncIterator[str]:
        sent_tokens = [0] * self.request.n
        done = [False] * self.request.n
        usage = None
        try:
            # Every choice opens with the assistant role, as OpenAI's streams do.
            for index in range(self.request.n):
                delta = DeltaMessage(role="assistant", content="")
                yield self._chunk([ChatStreamChoice(index=index, delta=delta)])
            async for _, output in self.group.outputs():
                for completion in output.outputs:
                    index = completion.index
                    if done[index]:
                        continue
                    parts = self.outputs[index]
                    num_new = len(completion.token_ids) - sent_tokens[index]
                    finished = completion.finish_reason is not None
                    delta = parts.delta(completion.text, finished)
                    if not (delta or finished or (self.request.logprobs and num_new > 0)):
                        continue
                    logprobs = self._logprobs(completion, sent_tokens[index])
                    sent_tokens[index] = len(completion.token_ids)
                    done[index] = finished
                    choice = ChatStreamChoice(
                        index=index,
                        delta=delta or DeltaMessage(),
                        logprobs=logprobs,
                        finish_reason=parts.finish_reason(finish_reason(completion.finish_reason)),
                        stop_reason=completion.stop_reason,
                    )
                    yield self._chunk([choice])
                if output.finished:
                    usage = self._usage(output)
            if self.request.include_usage and usage is not None:
                yield self._chunk([], usage)
        except APIError as e:
            if e.status == 499:
                return  # the client is gone
            yield sse(error_json(e.message, e.type, e.status))
        except Exception as e:
            yield sse(error_json(f"{type(e).__name__}: {e}", "InternalServerError", 500))
        finally:
            self.group.close()
        yield SSE_DONE
