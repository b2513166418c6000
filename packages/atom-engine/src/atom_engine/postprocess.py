"""Postprocessing: where a step's sampled tokens reach their requests, and the only place a
sequence finishes.

`Postprocessor` holds the engine's book of requests (request id -> `Request`, sequence id ->
`Request`) and its token counters. `postprocess` advances a synchronous step's sequences by its
`RunOutput`; `complete_launch` does the same for an async launch once its sampled ids have arrived
(putting them in place of the placeholders the launch left). Either returns the outputs of the
requests the step advanced; a request whose post-processing raises is finished with an error
output, the others go on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from atom_engine.completion import check_stop, complete_token
from atom_engine.outputs import CompletionOutput, Logprob, RequestOutput
from atom_engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from atom_engine.block_manager import BlockManager
    from atom_engine.intake import Request
    from atom_engine.sampler import TopLogprobs
    from atom_engine.scheduler import ScheduledBatch, Scheduler
    from atom_engine.sequence import Sequence
    from atom_engine.spec_decode import SpecDecodeStats
    from atom_engine.step_outputs import Launch, RunOutput

logger = logging.getLogger("atom_engine")

_FINISHED = SequenceStatus.FINISHED


class Postprocessor:
    """The engine's requests and what their steps produced (see the module doc). `spec_stats`:
    the speculative-decoding statistics the verified drafts are counted in (None without)."""

    def __init__(
        self,
        scheduler: Scheduler,
        block_manager: BlockManager,
        tokenizer,
        max_model_len: int,
        spec_stats: SpecDecodeStats | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.spec_stats = spec_stats
        self.requests: dict[str, Request] = {}
        self.seq_to_request: dict[int, Request] = {}
        self.host_sampled: set[str] = set()  # requests whose sampling needs the host each step
        self.prompt_tokens = 0  # totals since start
        self.generation_tokens = 0
        self.finished_requests = 0
        self.history: list[tuple[float, int, int]] = []  # (time, prompt tokens, output tokens)

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; True if it was still known."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.host_sampled.discard(request_id)
        for seq in request.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
            self.seq_to_request.pop(seq.seq_id, None)
        return True

    def fail_request(self, request: Request, error: Exception) -> RequestOutput:
        """Finish a request with an error (its blocks are freed); its final output."""
        logger.error("request %s failed", request.request_id, exc_info=error)
        message = f"{type(error).__name__}: {error}"
        self.abort(request.request_id)
        for seq in request.seqs:
            seq.finish_reason = "error"
        request.metrics.finished_time = time.monotonic()
        output = self.output_of(request)
        output.error = message
        return output

    # -- a synchronous step ---------------------------------------------------------------------

    def postprocess(self, batch: ScheduledBatch, result: RunOutput) -> list[RequestOutput]:
        now = time.monotonic()
        touched: dict[str, Request] = {}
        failed: list[RequestOutput] = []
        prompt_tokens = generation_tokens = 0
        for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
            request = self.seq_to_request.get(seq.seq_id)
            if request is None:  # failed with another sequence of its request
                continue
            try:
                new_prompt, new_generated = self._postprocess_seq(request, seq, num, result, now)
            except Exception as e:  # one request's failure (detokenizing, ...) is its own
                touched.pop(request.request_id, None)
                failed.append(self.fail_request(request, e))
                continue
            prompt_tokens += new_prompt
            generation_tokens += new_generated
            touched[request.request_id] = request
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.history.append((now, prompt_tokens, generation_tokens))
        return failed + self.finish_outputs(touched, now)

    def _postprocess_seq(
        self, request: Request, seq: Sequence, num: int, result: RunOutput, now: float
    ) -> tuple[int, int]:
        """Advance one sequence by a step's result; (prompt tokens, generated tokens) counted."""
        prompt_tokens = generated = 0
        num_drafts = len(seq.spec_token_ids)
        num -= num_drafts  # the tokens fed besides the drafts
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            prompt_tokens = min(num, seq.num_prompt_tokens - seq.num_computed_tokens)
        if seq.seq_id in result.prompt_logprobs and seq.index == 0:
            # Positions start+1...; a recomputed (preempted) prefill repeats known ones.
            first = seq.num_computed_tokens + 1
            for i, info in enumerate(result.prompt_logprobs[seq.seq_id]):
                if first + i == len(request.prompt_logprobs):
                    request.prompt_logprobs.append(self._logprob_dict(info))
        seq.num_computed_tokens += num
        self.block_manager.cache_computed_blocks(seq)
        emitted = result.sampled.get(seq.seq_id, ())
        if num_drafts:  # emitted: the accepted drafts, then the token drawn after them
            self.spec_stats.record(num_drafts, len(emitted) - 1)
            seq.spec_token_ids = []
        for token_id, info in emitted:
            if generated:  # the accepted draft before this token is in the cache
                seq.num_computed_tokens += 1
            self.append_token(seq, token_id, info)
            generated += 1
            if seq.is_finished:  # a stop inside the accepted run: the rest is dropped
                break
        if num_drafts and not seq.is_finished:
            self.block_manager.cache_computed_blocks(seq)
            self.block_manager.trim(seq)  # the rejected drafts' blocks
        if generated:
            if request.metrics.first_token_time is None:
                request.metrics.first_token_time = now
            request.metrics.last_token_time = now
        return prompt_tokens, generated

    def append_token(self, seq: Sequence, token_id: int, info: TopLogprobs | None) -> None:
        seq.token_ids.append(token_id)
        if info is not None:
            seq.cumulative_logprob += info.logprob
            seq.logprobs.append(self._logprob_dict(info))
        if check_stop(seq, token_id, self.max_model_len):
            self.scheduler.finish(seq)

    # -- an async launch ------------------------------------------------------------------------

    def complete_launch(self, launch: Launch) -> list[RequestOutput]:
        """Read a launch's sampled ids and post-process them like a synchronous step (the loop
        is flat: see `completion`)."""
        token_ids = launch.token_ids()
        now = time.monotonic()
        seq_to_request = self.seq_to_request
        bm, scheduler, max_model_len = self.block_manager, self.scheduler, self.max_model_len
        touched: dict[str, Request] = {}
        failed: list[RequestOutput] = []
        generated = 0
        sampled, num_sampled, row = launch.seqs, len(launch.seqs), 0
        for seq in launch.batch.seqs:
            token_id = None
            if row < num_sampled and sampled[row] is seq:  # sampled rows follow the batch's order
                token_id = token_ids[row]
                row += 1
            request = seq_to_request.get(seq.seq_id)
            if request is None or seq.status is _FINISHED:  # aborted, or stopped earlier
                continue
            try:
                if token_id is None:  # a prefill chunk: nothing sampled
                    bm.cache_computed_blocks(seq)
                else:
                    complete_token(seq, token_id, bm, scheduler, max_model_len)
                    generated += 1
                    metrics = request.metrics
                    if metrics.first_token_time is None:
                        metrics.first_token_time = now
                    metrics.last_token_time = now
            except Exception as e:  # one request's failure (detokenizing, ...) is its own
                touched.pop(request.request_id, None)
                failed.append(self.fail_request(request, e))
                continue
            touched[request.request_id] = request
        self.generation_tokens += generated
        self.history.append((now, 0, generated))
        return failed + self.finish_outputs(touched, now)

    # -- outputs --------------------------------------------------------------------------------

    def finish_outputs(self, touched: dict[str, Request], now: float) -> list[RequestOutput]:
        """The outputs of the requests a step advanced; the finished ones leave the book."""
        outputs = []
        for request in touched.values():
            if request.finished:
                request.metrics.finished_time = now
                self.requests.pop(request.request_id, None)
                self.host_sampled.discard(request.request_id)
                for seq in request.seqs:
                    self.seq_to_request.pop(seq.seq_id, None)
                self.finished_requests += 1
            elif request.params.output_kind == "final_only":
                continue
            outputs.append(self.output_of(request))
        return outputs

    def _decode_one(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _logprob_dict(self, info: TopLogprobs) -> dict[int, Logprob]:
        entry = {
            tid: Logprob(lp, rank + 1, self._decode_one(tid))
            for rank, (tid, lp) in enumerate(zip(info.top_ids, info.top_logprobs, strict=True))
        }
        if info.token_id not in entry:
            entry[info.token_id] = Logprob(info.logprob, info.rank, self._decode_one(info.token_id))
        return entry

    def output_of(self, request: Request) -> RequestOutput:
        request.metrics.num_cached_prompt_tokens = request.seqs[0].num_cached_prompt_tokens
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            prompt_logprobs=request.prompt_logprobs,
            metrics=request.metrics,
        )
