"""Sampling on rank 0: the logits of a step's sampled rows -> token ids (and log-probs).

`sample_on_device` is the overlapped path (ids stay on the device); `sample` the synchronous one
with every feature (log-probs, penalties, min_tokens, allowed token ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import atom_kernels
from atom_engine.sequence import Sequence


@dataclass
class TopLogprobs:
    """Log-probs of one position: the actual token's, and the top-N (ids and values)."""

    token_id: int
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sample_on_device(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Sampled ids [B] on the device, without a host sync on the paths that need none
        (greedy; temperature with or without seeds; min_tokens masks and top-k / top-p / min-p
        filters read their flags on the host and may wait for the device)."""
        logits = self._mask_logits(seqs, logits)
        if all(s.params.is_greedy for s in seqs):
            # The argmax of 16-bit logits is that of their (exact) fp32 copies, ties included.
            return logits.argmax(dim=-1)
        return self._draw(seqs, logits).token_ids

    @staticmethod
    def _mask_logits(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Logits with what a row may not sample set to -inf (a copy when any): tokens outside
        its allowed_token_ids, and its stop tokens while it is short of min_tokens."""
        masked = logits
        for i, s in enumerate(seqs):
            allowed = s.params.allowed_token_ids
            stops = s.params.all_stop_token_ids
            short = s.num_output_tokens < s.params.min_tokens and bool(stops)
            if allowed is None and not short:
                continue
            if masked is logits:
                masked = logits.clone()
            if allowed is not None:
                keep = torch.full_like(masked[i], float("-inf"))
                index = torch.tensor(allowed, dtype=torch.long, device=logits.device)
                keep[index] = 0.0
                masked[i] += keep
            if short:
                masked[i, list(stops)] = float("-inf")
        return masked

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor, num_logprobs: int = 0):
        """atom_kernels.sample over the sequences' parameters; filters no row uses are off."""
        params = [s.params for s in seqs]

        def column(values, dtype):
            return to_device(values, dtype, self.device)

        def optional(values, on, dtype):  # None when no row uses the filter
            return column(values, dtype) if any(on(v) for v in values) else None

        generators = [s.generator for s in seqs]
        return atom_kernels.sample(
            logits,
            column([p.temperature for p in params], torch.float32),
            optional([p.top_k for p in params], lambda k: k > 0, torch.int64),
            optional([p.top_p for p in params], lambda p: p < 1.0, torch.float32),
            optional([p.min_p for p in params], lambda p: p > 0.0, torch.float32),
            generators=generators if any(g is not None for g in generators) else None,
            num_logprobs=num_logprobs,
        )

    def sample(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> dict[int, tuple[int, TopLogprobs | None]]:
        params = [s.params for s in seqs]
        if all(
            p.is_greedy
            and p.logprobs is None
            and not p.has_penalties
            and p.min_tokens == 0
            and p.allowed_token_ids is None
            for p in params
        ):
            # NOTE: the common greedy batch needs one argmax kernel and one sync; the sampler's
            # general path adds a log-softmax over the vocabulary and host syncs on its flags.
            token_ids = logits.argmax(dim=-1).tolist()
            return {s.seq_id: (t, None) for s, t in zip(seqs, token_ids, strict=True)}
        device = logits.device
        raw_logits = logits
        if any(s.params.has_penalties for s in seqs):
            logits = self._apply_penalties(seqs, logits)
        logits = self._mask_logits(seqs, logits)
        num_logprobs = max((p.logprobs or 0) for p in params)
        result = self._draw(seqs, logits, num_logprobs)
        token_ids = result.token_ids.tolist()
        sampled: dict[int, tuple[int, TopLogprobs | None]] = {}
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        info = dict.fromkeys(range(len(seqs)))
        if want:
            # Log-probs of the raw logits (vLLM's default), with the chosen token's rank.
            logprobs = torch.log_softmax(raw_logits[want], dim=-1)
            chosen = torch.tensor([token_ids[i] for i in want], device=device)
            chosen_lp = logprobs.gather(1, chosen[:, None])
            ranks = (logprobs > chosen_lp).sum(dim=1) + 1
            top_lp, top_ids = result.top_logprobs[want], result.top_token_ids[want]
            for j, i in enumerate(want):
                n = params[i].logprobs
                info[i] = TopLogprobs(
                    token_id=token_ids[i],
                    logprob=chosen_lp[j, 0].item(),
                    top_ids=top_ids[j, :n].tolist(),
                    top_logprobs=top_lp[j, :n].tolist(),
                    rank=int(ranks[j]),
                )
        for i, s in enumerate(seqs):
            sampled[s.seq_id] = (token_ids[i], info[i])
        return sampled

    def _apply_penalties(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        device = logits.device

        def padded(rows: list[list[int]]) -> torch.Tensor:
            width = max(1, max(len(r) for r in rows))
            return torch.tensor(
                [r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64, device=device
            )

        return atom_kernels.apply_penalties(
            logits,
            padded([s.token_ids[: s.num_prompt_tokens] for s in seqs]),
            padded([s.output_token_ids for s in seqs]),
            torch.tensor([s.params.presence_penalty for s in seqs], device=device),
            torch.tensor([s.params.frequency_penalty for s in seqs], device=device),
            torch.tensor([s.params.repetition_penalty for s in seqs], device=device),
        )

    @staticmethod
    def logprobs_of(logits: torch.Tensor, targets: list[int], n: int) -> list[TopLogprobs]:
        logprobs = torch.log_softmax(logits, dim=-1)  # [R, V]
        target = torch.tensor(targets, device=logits.device)[:, None]
        chosen = logprobs.gather(1, target)
        ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
        top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], target[:, :0])
        return [
            TopLogprobs(t, chosen[i, 0].item(), top_ids[i].tolist(), top_lp[i].tolist(), ranks[i])
            for i, t in enumerate(targets)
        ]


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, through pinned memory so the copy does not block."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
