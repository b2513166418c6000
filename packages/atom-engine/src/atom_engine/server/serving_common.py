"""What the completion and chat handlers share: errors, sampling parameters, starting requests,
merging their output streams, aborting on disconnect, and the log-prob formats."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request

from atom_engine.outputs import RequestOutput
from atom_engine.sampling_params import SamplingParams, StructuredOutputsParams
from atom_engine.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    RequestAborted,
    RequestFailed,
)
from atom_engine.server.metrics import ServerMetrics
from atom_engine.server.preprocess import Preprocessor
from atom_engine.server.protocol import ErrorInfo, ErrorResponse, SamplingRequest

# Poll interval of the disconnect check while a request runs (seconds).
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {message, type, param, code}}."""

    TYPES = {
        400: "BadRequestError",
        401: "AuthenticationError",
        404: "NotFoundError",
        499: "ClientDisconnected",
        500: "InternalServerError",
        503: "ServiceUnavailableError",
    }

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.type = self.TYPES.get(status, "APIError")


@dataclass
class ServerState:
    engine: AsyncEngine
    served_model_name: str
    model_aliases: frozenset[str]  # other names accepted in `model` (the model path, ...)
    metrics: ServerMetrics
    preprocessor: Preprocessor  # tokenizes and checks prompts (and compiles grammars) off-loop
    tool_parser: str | None = None  # --tool-call-parser: tool_choice "auto" parses this format
    reasoning_parser: str | None = None  # --reasoning-parser: splits out reasoning_content

    @property
    def max_n(self) -> int:
        return self.engine.engine.config.max_num_seqs

    def check_model(self, model: str | None) -> None:
        if model is None or model == self.served_model_name or model in self.model_aliases:
            return
        raise APIError(f"The model `{model}` does not exist.", status=404, param="model")


# -- sampling parameters ----------------------------------------------------------------------

_FIELD = re.compile(r"SamplingParams\.(\w+)")


def sampling_params(
    request: SamplingRequest,
    max_n: int,
    max_tokens: int | None,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    param_names: dict[str, str] | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The request's SamplingParams; an invalid value is a 400 naming its field."""
    if request.store:
        raise APIError(
            "store: true asks the server to keep the completion; ATOM stores nothing (send "
            "store: false or leave it out)",
            param="store",
        )
    if request.use_beam_search:
        raise APIError("beam search is not supported", param="use_beam_search")
    if request.n > max_n:
        raise APIError(f"n must be at most {max_n} (max_num_seqs), got {request.n}", param="n")
    if request.prompt_logprobs is not None:
        if prompt_logprobs is not None and prompt_logprobs != request.prompt_logprobs:
            raise APIError(
                "prompt_logprobs must equal logprobs when echo is set", param="prompt_logprobs"
            )
        prompt_logprobs = request.prompt_logprobs

    def default(value, fallback):
        return fallback if value is None else value

    try:
        return SamplingParams(
            n=request.n,
            temperature=default(request.temperature, 1.0),
            top_p=default(request.top_p, 1.0),
            top_k=default(request.top_k, 0),
            min_p=default(request.min_p, 0.0),
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=request.stop,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=request.ignore_eos,
            presence_penalty=default(request.presence_penalty, 0.0),
            frequency_penalty=default(request.frequency_penalty, 0.0),
            repetition_penalty=default(request.repetition_penalty, 1.0),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            allowed_token_ids=request.allowed_token_ids,
            logit_bias=_logit_bias(request.logit_bias),
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=structured_outputs,
        )
    except ValueError as e:
        raise value_error(e, None, param_names) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON keys) with int keys; a 400 for a key that is not
    a token id."""
    if not bias:
        return None
    result = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise APIError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                param="logit_bias",
            )
        result[int(key)] = value
    return result


def value_error(
    error: ValueError, param: str | None, param_names: dict[str, str] | None = None
) -> APIError:
    """A 400 for a ValueError from the engine's checks: "SamplingParams.top_p must be ..." ->
    "top_p must be ...", param "top_p" (named as the request names it: a chat request's
    logprobs count is its top_logprobs); other messages get `param`."""
    match = _FIELD.search(str(error))
    if match is None:
        param = getattr(error, "param", None) or param
        return APIError(str(error), param=(param_names or {}).get(param, param))
    name = (param_names or {}).get(match.group(1), match.group(1))
    return APIError(_FIELD.sub(name, str(error), count=1), param=name)


# -- running requests -------------------------------------------------------------------------


class RequestGroup:
    """The engine requests behind one HTTP request (one per prompt), watched for disconnects.

    `outputs()` yields (prompt index, cumulative output) and records finished requests in the
    metrics; `close()` (always call it) aborts the requests that have not finished.
    """

    def __init__(
        self,
        state: ServerState,
        raw_request: Request,
        request_ids: list[str],
        streams: list[AsyncIterator[RequestOutput]],
        n: int,
    ) -> None:
        self.state, self.request_ids, self.streams, self.n = state, request_ids, streams, n
        self.unfinished = set(request_ids)
        self.watcher = DisconnectWatcher(raw_request, state.engine, request_ids)

    @classmethod
    async def start(
        cls,
        state: ServerState,
        raw_request: Request,
        base_id: str,
        prompts: list[tuple[dict, SamplingParams]],
    ) -> RequestGroup:
        """Add one engine request per (prompt, params): all of them, or none."""
        ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        # Added together so that they are admitted in the same engine step.
        results = await asyncio.gather(
            *(
                state.engine.add_request(request_id, prompt, params)
                for request_id, (prompt, params) in zip(ids, prompts, strict=True)
            ),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for request_id, result in zip(ids, results, strict=True):
                if not isinstance(result, BaseException):
                    state.engine.abort(request_id)
            error = errors[0]
            if isinstance(error, ValueError):
                raise value_error(error, None) from None
            if isinstance(error, EngineDeadError):
                raise APIError(str(error), status=503) from None
            raise error
        streams: list[AsyncIterator[RequestOutput]] = list(results)
        return cls(state, raw_request, ids, streams, prompts[0][1].n)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            async for index, output in merge(self.streams):
                if output.finished:
                    self.unfinished.discard(output.request_id)
                    self.state.metrics.observe(output)
                yield index, output
        except RequestAborted as e:
            if self.watcher.disconnected:
                raise APIError("the client disconnected", status=499) from None
            raise APIError(str(e), status=503) from None
        except RequestFailed as e:
            raise APIError(f"the engine failed this request: {e}", status=500) from None

    def close(self) -> None:
        self.watcher.stop()
        for request_id in self.unfinished:
            self.state.engine.abort(request_id)
        self.state.metrics.observe_aborted(len(self.unfinished) * self.n)
        self.unfinished.clear()


async def merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output), in arrival order."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
            await queue.put((index, None))
        except Exception as e:
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


class DisconnectWatcher:
    """Aborts the given requests when the HTTP client goes away (polls `is_disconnected`)."""

    def __init__(self, raw_request: Request, engine: AsyncEngine, request_ids: list[str]) -> None:
        self.raw_request, self.engine, self.request_ids = raw_request, engine, request_ids
        self.disconnected = False
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        try:
            while not await self.raw_request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)
        except Exception:
            return
        self.disconnected = True
        for request_id in self.request_ids:
            self.engine.abort(request_id)

    def stop(self) -> None:
        self._task.cancel()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = sse("[DONE]")


def error_json(message: str, type_: str, code: int, param: str | None = None) -> str:
    info = ErrorInfo(message=message, type=type_, param=param, code=code)
    return ErrorResponse(error=info).model_dump_json()


# -- log-probs --------------------------------------------------------------------------------


def finish_reason(reason: str | None) -> str | None:
    """What clients see: "stop" or "length" ("abort" is never answered)."""
    return reason if reason in (None, "stop", "length") else "stop"
