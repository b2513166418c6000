"""Speculative decoding: the drafters (n-gram and MTP) and their statistics; the configuration is
`spec_config`.

The verification is `atom_kernels.rejection_sample` (lossless: the emitted tokens follow the
target model's distribution). Drafts come from prompt lookup (`method: "ngram"`: the tokens that
followed the latest earlier occurrence of the sequence's last n tokens, any model) or from a
DeepSeek-V3-family checkpoint's MTP layer (`method: "mtp"`).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

from atom_engine.spec_config import SpeculativeConfig
from atom_engine.step_inputs import StepInputs

logger = logging.getLogger("atom_engine")


def check_speculative(spec: SpeculativeConfig | None, config, hf_config) -> None:
    """Raise ValueError when the engine cannot speculate as configured (at start)."""
    if spec is None or spec.method != "mtp":
        return
    layers = getattr(hf_config, "num_nextn_predict_layers", 0) or 0
    if layers < 1:
        raise ValueError(
            "speculative_config.method 'mtp' needs a checkpoint with multi-token-prediction "
            f"layers (num_nextn_predict_layers >= 1); {config.model or 'the model'} has none "
            "(use method 'ngram')"
        )
    if config.tensor_parallel_size > 1:
        raise ValueError(
            "speculative_config.method 'mtp' runs with tensor_parallel_size 1 only for now "
            f"(got {config.tensor_parallel_size}); method 'ngram' runs with any"
        )


def ngram_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens by prompt lookup: for n from max_n down to min_n, find the latest
    earlier occurrence of the last n tokens and propose the (up to k) tokens that followed it;
    [] when no suffix of those lengths occurred before."""
    if k < 1 or len(tokens) < min_n + 1:
        return []
    # Search the token ids as 4-byte words with bytes.rfind (C speed), keeping word alignment.
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = data[-4 * n :]
        end = len(data) - 4  # an occurrence must end before the last token (not be the suffix)
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return list(tokens[start : start + k])
            end = at + len(pattern) - 1
    return []


@dataclass
class SpecDecodeStats:
    """Totals since start: verification runs with drafts, draft tokens proposed, drafts accepted,
    and acceptances per draft position (position 0: the first draft of a run)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    _proposed: list[int] = field(default_factory=list, repr=False)  # runs reaching a position

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def acceptance_rate_per_position(self) -> list[float]:
        """Accepted / proposed at each position (runs shorter than a position do not count)."""
        pairs = zip(self.accepted_per_position, self._proposed, strict=True)
        return [accepted / proposed for accepted, proposed in pairs]

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self._proposed)
        if grow > 0:
            self._proposed += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(num_draft_tokens):
            self._proposed[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @staticmethod
    def merge(parts: list[SpecDecodeStats]) -> SpecDecodeStats:
        total = SpecDecodeStats()
        for part in parts:
            total.num_drafts += part.num_drafts
            total.num_draft_tokens += part.num_draft_tokens
            total.num_accepted_tokens += part.num_accepted_tokens
            for name in ("accepted_per_position", "_proposed"):
                mine, theirs = getattr(total, name), getattr(part, name)
                mine += [0] * (len(theirs) - len(mine))
                for i, v in enumerate(theirs):
                    mine[i] += v
        return total


def draft_limit(seq, k: int, max_model_len: int) -> int:
    """How many drafts a sequence may take after this step: none unless it is decoding (one
    uncomputed token) without penalties (its logits would depend on every earlier draft); else at
    most k, the positions left below max_model_len (drafts sit at len .. len + k - 1) and the
    tokens the request may still emit after the one the verification adds."""
    if seq.num_uncomputed_tokens != 1 or seq.params.has_penalties:
        return 0
    return min(k, seq.params.max_tokens - seq.num_output_tokens - 1, max_model_len - len(seq))


class NgramDrafter:
    """Proposes each running decode's drafts by prompt lookup (`ngram_propose`) after a step,
    as many as the request may still emit; requests with penalties get none (their logits
    depend on every earlier token, which the verification does not recompute per draft)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()

    def propose(self, batch, running) -> None:
        """Drafts for every running sequence (`batch`, the step just run, is not needed)."""
        cfg = self.config
        for seq in running:
            seq.spec_token_ids = []
            limit = draft_limit(seq, cfg.num_speculative_tokens, self.max_model_len)
            if limit > 0:
                seq.spec_token_ids = ngram_propose(
                    seq.token_ids, limit, cfg.prompt_lookup_min, cfg.prompt_lookup_max
                )


class MtpDrafter:
    """Drafts with the checkpoint's multi-token-prediction layers (DeepSeek-V3 family).

    After each step the MTP layer runs over the positions the step put in the cache, each fed the
    target's hidden state there and the token that follows it (so the layer's own KV cache, in
    the same blocks as the target's, covers every position, prompts included); its output at a
    decoding sequence's last position predicts the token after the one just emitted: the first
    draft. k > 1 chains the layer on its own output, one position further each time. Drafts are
    the layer's argmax (a one-hot q, so the verification stays lossless)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, runner, block_manager):
        self.config = config
        self.max_model_len = max_model_len
        self.runner, self.block_manager = runner, block_manager
        self.stats = SpecDecodeStats()

    def propose(self, batch, running) -> None:
        """Drafts for the sequences of `batch`, the step the runner just ran (`running` is not
        needed: the others keep the drafts of their own last step)."""
        try:
            self._propose(batch, self.runner.step_rows)
        except Exception:  # a draft is an optimisation: without one the requests go on
            logger.exception("MTP drafting failed; the next step runs without drafts")
            for seq in batch.seqs:
                seq.spec_token_ids = []

    def _propose(self, batch, step_rows: dict[int, tuple[int, int]]) -> None:
        """step_rows: seq_id -> (first row in the step's hidden states, first position)."""
        inputs = StepInputs([], [], [], [], [], [], [])
        hidden_rows: list[int] = []
        drafting = []  # (sequence, how many drafts it may take)
        for seq in batch.seqs:
            seq.spec_token_ids = []
            if seq.is_finished or seq.seq_id not in step_rows:
                continue
            row, start = step_rows[seq.seq_id]
            valid = seq.num_computed_tokens - start  # positions this step put in the cache
            if valid <= 0:
                continue
            inputs.ids += seq.token_ids[start + 1 : start + valid + 1]  # the token after each
            inputs.seq_lens.append(start + valid)
            inputs.query_lens.append(valid)
            inputs.tables.append(seq.block_table)
            hidden_rows += range(row, row + valid)
            limit = draft_limit(seq, self.config.num_speculative_tokens, self.max_model_len)
            if limit > 0:
                inputs.sample_rows.append(len(inputs.ids) - 1)
                drafting.append((seq, limit))
        if not inputs.ids:
            return
        drafts, hidden = self.runner.mtp_draft(inputs, hidden_rows, 0)
        for (seq, _), token in zip(drafting, drafts, strict=True):
            seq.spec_token_ids = [token]
        for step in range(1, self.config.num_speculative_tokens):
            # Chain: the layer's own output and draft at the next position, for the sequences
            # that may take another draft and whose blocks can hold that position.
            keep = [
                i
                for i, (seq, limit) in enumerate(drafting)
                if limit > step and self._fits(seq, step)
            ]
            if not keep:
                break
            inputs = StepInputs([], [], [], [], [], [], [])
            for i in keep:
                seq = drafting[i][0]
                inputs.ids.append(seq.spec_token_ids[-1])
                inputs.seq_lens.append(len(seq) - 1 + step)  # at position len(seq) - 2 + step
                inputs.query_lens.append(1)
                inputs.tables.append(seq.block_table)
                inputs.sample_rows.append(len(inputs.sample_rows))
            drafts, hidden = self.runner.mtp_draft(inputs, None, step, hidden[keep])
            drafting = [drafting[i] for i in keep]
            for (seq, _), token in zip(drafting, drafts, strict=True):
                seq.spec_token_ids.append(token)

    def _fits(self, seq, step: int) -> bool:
        """Room in seq's blocks for the MTP cache entry at position len(seq) - 2 + step (blocks
        are grown here when free ones are left; the next step needs them for the drafts)."""
        bm = self.block_manager
        new = len(seq) - 1 + step - seq.num_computed_tokens
        if not bm.can_allocate(seq, new):
            return False
        bm.allocate(seq, new)
        return True
