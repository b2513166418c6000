"""A sequence's state: its tokens, how many are in the KV cache, and its blocks.

The scheduler owns sequences; only `postprocess` (in the engine) appends tokens or finishes one.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING

import torch

from atom_engine.detokenizer import IncrementalDetokenizer
from atom_engine.outputs import SampleLogprobs
from atom_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from atom_engine.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_ids = itertools.count()

# The id a sequence holds for a token its last launch sampled but the host has not read yet
# (async scheduling); the device fills it in, the engine replaces it when the step completes.
PLACEHOLDER = -1


class Sequence:
    def __init__(
        self,
        request_id: str,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        arrival_time: float,
        generator: torch.Generator | None = None,
    ) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id, self.index = request_id, index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.detokenizer = detokenizer
        self.arrival_time = arrival_time
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks, in order
        self.num_published_blocks = 0  # leading blocks whose hashes the prefix cache holds
        self.num_cached_prompt_tokens = 0  # prompt tokens served from the prefix cache
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # Speculative decoding: draft tokens proposed to follow token_ids, verified by the next
        # step (never in token_ids: only accepted drafts join them, so the prefix-cache hashes
        # and the detokenizer see real tokens only).
        self.spec_token_ids: list[int] = []
        self.grammar: GrammarState | None = None  # structured output: where the grammar stands

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed_tokens > 1

    @property
    def output_text(self) -> str:
        return self.detokenizer.visible_text(self.is_finished)
