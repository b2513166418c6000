"""What a step hands back to the engine: `RunOutput` from `ModelRunner.run` (waited for), `Launch`
from `ModelRunner.launch` (queued on the device, its sampled ids read later)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from atom_engine.sampler import TopLogprobs
    from atom_engine.scheduler import ScheduledBatch
    from atom_engine.sequence import Sequence


@dataclass
class Launch:
    """A step queued on the device (`ModelRunner.launch`): its sampled ids arrive in pinned host
    memory when `ready` has passed."""

    batch: ScheduledBatch
    seqs: list[Sequence]  # the sampled sequences, in `sampled` row order
    rows: dict[int, int]  # seq_id -> row of `sampled` (and of host)
    host: torch.Tensor  # pinned int64 [len(seqs)]
    ready: torch.cuda.Event | None  # None on the CPU (the copy was synchronous)

    def token_ids(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


@dataclass
class RunOutput:
    # seq_id -> the tokens it emits (sampled id, its TopLogprobs or None): one, or with
    # speculative drafts the accepted drafts and the token drawn after them
    sampled: dict[int, list[tuple[int, TopLogprobs | None]]]
    # seq_id -> prompt log-probs of the prompt positions computed in this step, in order
    prompt_logprobs: dict[int, list[TopLogprobs]]
