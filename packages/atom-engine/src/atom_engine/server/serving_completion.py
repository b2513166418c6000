"""POST /v1/completions: prompts (text or token ids) in, completions out, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request

from atom_engine.outputs import CompletionOutput, RequestOutput
from atom_engine.server.logprobs import completion_logprobs, prompt_logprobs_json
from atom_engine.server.protocol import CompletionRequest, random_id
from atom_engine.server.responses import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogProbs,
    CompletionResponse,
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
from atom_engine.server.structured import structured_spec


def _prompts(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    if any(isinstance(p, list) and not p for p in prompt):
        raise APIError("a token-id prompt must not be empty", param="prompt")
    return list(prompt)


def _prompt_text(output: RequestOutput, tokenizer) -> str:
    if output.prompt is not None:
        return output.prompt
    return tokenizer.decode(output.prompt_token_ids)


async def create_completion(state: ServerState, request: CompletionRequest, raw_request: Request):
    state.check_model(request.model)
    if request.suffix is not None:
        raise APIError("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise APIError("best_of must equal n: ATOM does not rank completions", param="best_of")
    score_only = request.max_tokens == 0
    if score_only and not request.echo:
        raise APIError(
            "max_tokens must be at least 1 (0 is allowed with echo, to score the prompt)",
            param="max_tokens",
        )
    prompts = _prompts(request.prompt)
    echo_logprobs = request.logprobs if request.echo else None
    spec, source = structured_spec(request)
    if spec is not None and score_only:
        raise APIError("max_tokens 0 (scoring) generates nothing to constrain", param=source)
    params = sampling_params(
        request,
        state.max_n,
        1 if score_only else request.max_tokens,
        logprobs=request.logprobs,
        prompt_logprobs=echo_logprobs,
        param_names={"structured_outputs": source},
        structured_outputs=spec,
    )
    try:
        engine_prompts = await state.preprocessor.run(
            state.preprocessor.completion_prompts, prompts, params
        )
    except ValueError as e:
        raise value_error(e, "prompt", {"structured_outputs": source}) from None
    completion_id = random_id("cmpl")
    group = await RequestGroup.start(state, raw_request, completion_id, engine_prompts)
    stream = _CompletionStream(state, request, group, completion_id, score_only)
    if request.stream:
        return StreamingResponse(stream.events(), media_type="text/event-stream")
    finals: list[RequestOutput | None] = [None] * len(prompts)
    try:
        async for index, output in group.outputs():
            finals[index] = output
    finally:
        group.close()
    return JSONResponse(stream.response(finals).model_dump())


class _CompletionStream:
    """Builds the response, or the SSE chunks, of one completion request."""

    def __init__(
        self,
        state: ServerState,
        request: CompletionRequest,
        group: RequestGroup,
        rid: str,
        score_only: bool,
    ) -> None:
        self.state, self.request, self.group, self.id = state, request, group, rid
        self.tokenizer = state.engine.tokenizer
        self.created = int(time.time())
        self.score_only = score_only  # max_tokens 0: the one token generated is not shown

    def _shown(self, completion: CompletionOutput) -> CompletionOutput:
        """What the client sees of a completion: nothing generated when scoring the prompt."""
        if not self.score_only:
            return completion
        return CompletionOutput(
            index=completion.index,
            text="",
            token_ids=[],
            logprobs=None if completion.logprobs is None else [],
            finish_reason="length" if completion.finish_reason is not None else None,
        )

    def _prompt_logprobs(self, output: RequestOutput) -> list | None:
        if self.request.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(output.prompt_logprobs)

    def _logprobs(
        self,
        output: RequestOutput,
        completion: CompletionOutput,
        start: int,
        text_offset: int,
        with_prompt: bool,
    ) -> tuple[CompletionLogProbs | None, int]:
        """Log-probs of the completion's tokens from `start` (and the prompt's, if echoed)."""
        if self.request.logprobs is None:
            return None, text_offset
        token_ids = list(completion.token_ids[start:])
        logprobs = list((completion.logprobs or [])[start:])
        if with_prompt:
            prompt_ids = output.prompt_token_ids
            prompt_logprobs = output.prompt_logprobs or [None] * len(prompt_ids)
            token_ids = prompt_ids + token_ids
            logprobs = list(prompt_logprobs[: len(prompt_ids)]) + logprobs
        return completion_logprobs(
            token_ids, logprobs, self.request.logprobs, self.tokenizer, text_offset
        )

    def response(self, finals: list[RequestOutput | None]) -> CompletionResponse:
        request, n = self.request, self.request.n
        choices, usage = [], UsageInfo()
        for index, output in enumerate(finals):
            assert output is not None and output.finished
            usage.prompt_tokens += len(output.prompt_token_ids)
            prompt_text = _prompt_text(output, self.tokenizer) if request.echo else ""
            for completion in map(self._shown, output.outputs):
                usage.completion_tokens += len(completion.token_ids)
                logprobs, _ = self._logprobs(output, completion, 0, 0, request.echo)
                choices.append(
                    CompletionChoice(
                        index=index * n + completion.index,
                        text=prompt_text + completion.text,
                        logprobs=logprobs,
                        finish_reason=finish_reason(completion.finish_reason),
                        stop_reason=completion.stop_reason,
                        prompt_logprobs=self._prompt_logprobs(output),
                    )
                )
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.state.served_model_name,
            choices=choices,
            usage=usage,
        )

    def _chunk(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        chunk = CompletionChunk(
            id=self.id,
            created=self.created,
            model=self.state.served_model_name,
            choices=choices,
            usage=usage,
        )
        return sse(chunk.model_dump_json(exclude_none=usage is None))

    async def events(self) -> AsyncIterator[str]:
        request, n = self.request, self.request.n
        sent_chars: dict[int, int] = {}  # choice index -> characters of text sent
        sent_tokens: dict[int, int] = {}
        offsets: dict[int, int] = {}  # choice index -> text offset of its next token
        done: set[int] = set()
        usage = UsageInfo()
        try:
            async for index, output in self.group.outputs():
                for completion in map(self._shown, output.outputs):
                    choice = index * n + completion.index
                    if choice in done:
                        continue
                    if not completion.token_ids and completion.finish_reason is None:
                        continue  # still in prefill (its prompt log-probs are not all in yet)
                    first = choice not in sent_chars
                    prefix = ""
                    if first:
                        sent_chars[choice] = sent_tokens[choice] = offsets[choice] = 0
                        if request.echo:
                            prefix = _prompt_text(output, self.tokenizer)
                    text = completion.text[sent_chars[choice] :]
                    num_new = len(completion.token_ids) - sent_tokens[choice]
                    finished = completion.finish_reason is not None
                    wants_logprobs = request.logprobs is not None and num_new > 0
                    if not (prefix or text or finished or wants_logprobs):
                        continue
                    logprobs, offsets[choice] = self._logprobs(
                        output,
                        completion,
                        sent_tokens[choice],
                        offsets[choice],
                        first and request.echo,
                    )
                    sent_chars[choice] = len(completion.text)
                    sent_tokens[choice] = len(completion.token_ids)
                    if finished:
                        done.add(choice)
                    yield self._chunk(
                        [
                            CompletionChoice(
                                index=choice,
                                text=prefix + text,
                                logprobs=logprobs,
                                finish_reason=finish_reason(completion.finish_reason),
                                stop_reason=completion.stop_reason,
                                prompt_logprobs=self._prompt_logprobs(output) if first else None,
                            )
                        ]
                    )
                if output.finished:
                    usage.prompt_tokens += len(output.prompt_token_ids)
                    usage.completion_tokens += sum(
                        len(self._shown(c).token_ids) for c in output.outputs
                    )
            if request.include_usage:
                usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
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
