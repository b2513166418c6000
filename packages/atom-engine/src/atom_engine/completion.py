"""A generated token joining its sequence: the stop checks, and an async launch's sampled id put
in place of the placeholder it left (`Postprocessor.complete_launch` loops over the launch).

The completion runs once per sequence per step on the host, between the device's steps: at batch
256 it was the largest part of a decode step's host time, so its loop is written flat (no
per-sequence searches or list copies; the in-flight placeholder stays in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from atom_engine.sequence import PLACEHOLDER, Sequence

if TYPE_CHECKING:
    from atom_engine.block_manager import BlockManager
    from atom_engine.scheduler import Scheduler


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


def complete_token(
    seq: Sequence,
    token_id: int,
    block_manager: BlockManager,
    scheduler: Scheduler,
    max_model_len: int,
) -> None:
    """Put an async launch's sampled `token_id` in place of the placeholder it left in `seq`,
    publish the blocks it completed and check the stops (a finished sequence drops the token of
    the launch still in flight)."""
    ids = seq.token_ids
    # This launch's placeholder: the last token, or the one before the placeholder of the launch
    # in flight (one launch is pending at a time).
    last = len(ids) - 1
    index = last - 1 if ids[last - 1] == PLACEHOLDER else last
    ids[index] = token_id
    bm = block_manager
    if bm.enable_prefix_caching and seq.num_computed_tokens // bm.block_size > (
        seq.num_published_blocks
    ):
        bm.cache_computed_blocks(seq)
    if check_stop(seq, token_id, max_model_len, last - index):
        del ids[index + 1 :]  # the in-flight token is thrown away
        scheduler.finish(seq)
