"""The scheduler: which sequences run this step, and how many of their tokens.

Each step fills a token budget (`max_num_batched_tokens`): running sequences first (decodes, and
prefills that were cut into chunks), then waiting ones in arrival order, their prompts chunked to
fit. Prefill and decode share one step. While other sequences run or wait, one prefill takes at
most `long_prefill_token_threshold` tokens of a step, so a long prompt can neither hold the whole
budget step after step nor stretch the others' steps: requests behind it start, and streams keep
decoding, beside its chunks (alone, it takes the whole budget). When the KV cache runs out of
blocks, the most recently arrived running sequence is preempted: its blocks are released and it
goes back to the front of the queue to be recomputed (its prefix, likely still cached, makes that
cheap).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from atom_engine.block_manager import BlockManager
from atom_engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """Sequences of one step and how many new tokens each feeds (in that order)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def is_decode_only(self) -> bool:
        """Every sequence feeds one token, its last (no drafts): a step of plain decodes."""
        if not self.seqs or max(self.num_tokens) != 1 or min(self.num_tokens) != 1:
            return False
        return all(
            len(s.token_ids) - s.num_computed_tokens == 1 and not s.spec_token_ids
            for s in self.seqs
        )


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold  # 0: no cap
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished (or aborted) sequence and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.spec_token_ids.clear()
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.spec_token_ids.clear()
        self.block_manager.release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        threshold = self.long_prefill_token_threshold or budget

        def cap(num_waiting: int) -> int:
            """The most one prefill takes this step: capped while it shares the engine."""
            return threshold if num_waiting else budget

        # 1. Running sequences, oldest first; preempt the newest when blocks run out. A sequence
        # whose last token is still on its way (async scheduling) and is its max_tokens-th waits:
        # it finishes when that token arrives.
        # A decode with speculative drafts feeds its last token and the drafts (drafts are cut
        # to what the budget and the free blocks allow before anyone is preempted for them).
        # A plain decode (one token, no drafts) whose token lands in a block it holds needs no
        # allocation: it takes the short path (no block-manager calls; at batch 256 the
        # general one was most of this loop's time).
        block_size = bm.block_size
        queue = deque(
            s for s in self.running if len(s.token_ids) - s.num_prompt_tokens < s.params.max_tokens
        )
        while queue and budget > 0:
            seq = queue.popleft()
            computed = seq.num_computed_tokens
            if (
                len(seq.token_ids) - computed == 1
                and not seq.spec_token_ids
                and computed < len(seq.block_table) * block_size
            ):
                batch.seqs.append(seq)
                batch.num_tokens.append(1)
                budget -= 1
                continue
            others = len(self.running) - 1 + len(self.waiting)
            num = min(seq.num_uncomputed_tokens + len(seq.spec_token_ids), budget, cap(others))
            del seq.spec_token_ids[max(0, num - seq.num_uncomputed_tokens) :]
            while not bm.can_allocate(seq, num):
                if seq.spec_token_ids:
                    num -= len(seq.spec_token_ids)
                    seq.spec_token_ids.clear()
                    continue
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    break
            else:
                bm.allocate(seq, num)
                batch.seqs.append(seq)
                batch.num_tokens.append(num)
                budget -= num

        # 2. Waiting sequences in arrival order, while budget, slots and blocks last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if batch.num_preempted:
                break  # blocks are short this step; do not admit new work
            seq = self.waiting[0]
            bm.match_prefix(seq)
            num = min(
                seq.num_uncomputed_tokens, budget, cap(len(self.running) + len(self.waiting) - 1)
            )
            if not bm.can_allocate(seq, num):
                # Give the matched prefix back: a waiting sequence holds no blocks.
                bm.release(seq)
                # The engine rejects requests larger than the whole cache, so with nothing
                # running every block is free and this cannot happen.
                assert self.running, f"request {seq.request_id} cannot fit in an empty cache"
                break
            bm.allocate(seq, num)
            bm.record_prefix_lookup(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(num)
            budget -= num
        return batch
