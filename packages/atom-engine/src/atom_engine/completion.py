"""A generated token joining its sequence: the stop checks, and the completion of an async launch
(its sampled ids put in place of the placeholders it left).

The completion runs once per sequence per step on the host, between the device's steps: at batch
256 it was the largest part of a decode step's host time, so its loop is written flat (no
per-sequence searches or list copies; the in-flight placeholder stays in place).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from atom_engine.outputs import RequestOutput
from atom_engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

if TYPE_CHECKING:
    from atom_engine.engine import LLMEngine
    from atom_engine.step_outputs import Launch

_FINISHED = SequenceStatus.FINISHED


def check_stop(seq: Sequence, token_id: int, max_model_len: int, num_ahead: int = 0) -> bool:
    """Set seq's finish reason for token_id, its newest real token, followed in `token_ids` by
    `num_ahead` placeholders of a launch still in flight; True when the sequence finished."""
    params = seq.params
    # Stop tokens cannot be sampled before min_tokens (the runner masks them).
    is_stop_token = token_id in params.all_stop_token_ids
    # A grammar terminates on a stop token (EOS too when ignore_eos is set): not text.
    grammar_done = seq.grammar is not None and seq.grammar.advance([token_id])
    num_tokens = len(seq.token_ids) - num_ahead
    num_output = num_tokens - seq.num_prompt_tokens
    stop = seq.detokenizer.add(
        token_id,
        emit_text=not (is_stop_token or grammar_done),
        match_stop=num_output >= params.min_tokens,
    )
    if is_stop_token:
        seq.finish_reason = "stop"
        seq.stop_reason = token_id if token_id in params.stop_token_ids else None
    elif stop is not None:
        seq.finish_reason, seq.stop_reason = "stop", stop
    elif grammar_done:
        seq.finish_reason = "stop"
    elif num_output >= params.max_tokens or num_tokens >= max_model_len:
        seq.finish_reason = "length"
    return seq.finish_reason is not None


def complete_launch(engine: LLMEngine, launch: Launch) -> list[RequestOutput]:
    """Read a launch's sampled ids and post-process them like a synchronous step."""
    token_ids = launch.token_ids()
    now = time.monotonic()
    seq_to_request = engine._seq_to_request
    bm = engine.block_manager
    touched: dict[str, object] = {}
    failed: list[RequestOutput] = []
    generated = 0
    sampled, num_sampled, row = launch.seqs, len(launch.seqs), 0
    for seq in launch.batch.seqs:
        token_id = None
        if row < num_sampled and sampled[row] is seq:  # sampled rows follow the batch's order
            token_id = token_ids[row]
            row += 1
        request = seq_to_request.get(seq.seq_id)
        if request is None or seq.status is _FINISHED:  # aborted, or stopped by an earlier token
            continue
        try:
            if token_id is None:  # a prefill chunk: nothing sampled
                bm.cache_computed_blocks(seq)
            else:
                generated += _complete_token(engine, seq, token_id, request.metrics, now)
        except Exception as e:  # one request's failure (detokenizing, ...) is its own
            touched.pop(request.request_id, None)
            failed.append(engine._fail_request(request, e))
            continue
        touched[request.request_id] = request
    engine._generation_tokens += generated
    engine._history.append((now, 0, generated))
    return failed + engine._finish_outputs(touched, now)


def _complete_token(engine: LLMEngine, seq: Sequence, token_id: int, metrics, now: float) -> int:
    ids = seq.token_ids
    # This launch's placeholder: the last token, or the one before the placeholder of the launch
    # in flight (one launch is pending at a time).
    last = len(ids) - 1
    index = last - 1 if ids[last - 1] == PLACEHOLDER else last
    ids[index] = token_id
    bm = engine.block_manager
    if bm.enable_prefix_caching and seq.num_computed_tokens // bm.block_size > (
        seq.num_published_blocks
    ):
        bm.cache_computed_blocks(seq)
    if check_stop(seq, token_id, engine.max_model_len, last - index):
        del ids[index + 1 :]  # the in-flight token is thrown away
        engine.scheduler.finish(seq)
    if metrics.first_token_time is None:
        metrics.first_token_time = now
    metrics.last_token_time = now
    return 1
