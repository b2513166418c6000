"""Sampling on rank 0: the logits of a step's sampled rows -> token ids (and log-probs).

`sample_on_device` is the overlapped path (ids stay on the device); `sample` the synchronous one
with every feature (log-probs, penalties, min_tokens, allowed token ids).
"""

from __future__ import annotations

import itertools
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

    def sample_on_device(
        self, seqs: list[Sequence], logits: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Sampled ids [B] on the device (in ``out``, int64 [B], when given), without a host sync
        on the paths that need none (greedy; temperature with or without seeds; min_tokens masks
        and top-k / top-p / min-p filters read their flags on the host and may wait for the
        device)."""
        logits = self._mask_logits(seqs, logits)
        if all(s.params.is_greedy for s in seqs):
            # The argmax of 16-bit logits is that of their (exact) fp32 copies, ties included.
            # greedy_argmax is torch.argmax's result (a Triton kernel on GPUs unless
            # ATOM_TRITON_ARGMAX=0), written straight into `out`: no copy after it.
            return atom_kernels.greedy_argmax(logits, out)
        token_ids = self._draw(seqs, logits).token_ids
        return token_ids if out is None else out.copy_(token_ids)

    @staticmethod
    def _mask_logits(
        seqs: list[Sequence],
        logits: torch.Tensor,
        ahead: list[int] | None = None,
        is_biased: bool = False,
    ) -> torch.Tensor:
        """Logits with each row's logit_bias added and what a row may not sample set to -inf
        (a copy when any): tokens outside its allowed_token_ids, and its stop tokens while it is
        short of min_tokens. `ahead[i]`: tokens row i's sequence will have emitted before row
        i's (speculative draft rows). `is_biased`: the bias is in `logits` already."""
        masked = logits if is_biased else _biased(seqs, logits)
        # Only rows with allowed_token_ids or min_tokens can mask anything (the common batch
        # has none: one pass over the parameters, not the per-row checks).
        rows = [
            i
            for i, s in enumerate(seqs)
            if s.params.min_tokens
            or s.params.allowed_token_ids is not None
            or s.params.thinking_budget is not None
        ]
        for i in rows:
            s = seqs[i]
            allowed = s.params.allowed_token_ids
            stops = s.params.all_stop_token_ids
            emitted = s.num_output_tokens + (ahead[i] if ahead else 0)
            short = emitted < s.params.min_tokens and bool(stops)
            forced = _forced_thinking_end(s, emitted, ahead[i] if ahead else 0)
            if forced is not None:  # overrides every other filter of the row
                if masked is logits:
                    masked = logits.clone()
                masked[i] = float("-inf")
                masked[i, forced] = 0.0
                continue
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

    def _draw(self, seqs: list[Sequence], logits: torch.Tensor):
        """atom_kernels.sample over the sequences' parameters; filters no row uses are off."""
        params = [s.params for s in seqs]

        def column(values, dtype):
            return to_device(values, dtype, self.device)

        # Each filter is off (None) when no row uses it; min / max test that in C.
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        generators = [s.generator for s in seqs]
        return atom_kernels.sample(
            logits,
            column([p.temperature for p in params], torch.float32),
            column(top_k, torch.int64) if max(top_k) > 0 else None,
            column(top_p, torch.float32) if min(top_p) < 1.0 else None,
            column(min_p, torch.float32) if max(min_p) > 0.0 else None,
            generators=None if generators.count(None) == len(generators) else generators,
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
            and p.logit_bias is None
            and p.thinking_budget is None
            for p in params
        ):
            # NOTE: the common greedy batch needs one argmax kernel and one sync; the sampler's
            # general path adds a log-softmax over the vocabulary and host syncs on its flags.
            token_ids = atom_kernels.greedy_argmax(logits).tolist()
            return {s.seq_id: (t, None) for s, t in zip(seqs, token_ids, strict=True)}
        raw_logits = logits
        logits = _biased(seqs, logits)  # before the penalties, as vLLM orders them
        if any(s.params.has_penalties for s in seqs):
            logits = self._apply_penalties(seqs, logits)
        logits = self._mask_logits(seqs, logits, is_biased=True)
        token_ids = self._draw(seqs, logits).token_ids.tolist()
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        info = dict.fromkeys(range(len(seqs)))
        infos = _logprob_infos(raw_logits, want, [token_ids[i] for i in want], params)
        info.update(zip(want, infos, strict=True))
        return {s.seq_id: (token_ids[i], info[i]) for i, s in enumerate(seqs)}

    def verify(
        self, seqs: list[Sequence], logits: torch.Tensor
    ) -> dict[int, list[tuple[int, TopLogprobs | None]]]:
        """Speculative decoding's verification: each sequence's drafts (`spec_token_ids`, k_i)
        against its k_i + 1 rows of logits (the draft positions, then the one after them), by
        rejection sampling (`atom_kernels.rejection_sample`): the accepted drafts and one more
        token per sequence, distributed exactly as sampling without drafts. Every sampling
        parameter but the penalties applies per row (the drafter proposes nothing for requests
        with penalties); seeded sequences draw from their own generator."""
        counts = [len(s.spec_token_ids) + 1 for s in seqs]
        row_seqs = [s for s, c in zip(seqs, counts, strict=True) for _ in range(c)]
        ahead = [j for c in counts for j in range(c)]
        params = [s.params for s in row_seqs]
        masked = self._mask_logits(row_seqs, logits, ahead)
        if all(s.params.is_greedy for s in seqs):  # accept while the draft is the argmax
            targets = masked.argmax(dim=-1).tolist()
            emitted, at = [], 0
            for s, c in zip(seqs, counts, strict=True):
                rows = targets[at : at + c]
                n = next((j for j, d in enumerate(s.spec_token_ids) if d != rows[j]), c - 1)
                emitted.append(rows[: n + 1])
                at += c
        else:
            emitted = self._rejection_sample(seqs, counts, row_seqs, masked)
        out: dict[int, list[tuple[int, TopLogprobs | None]]] = {}
        want, tokens, at = [], [], 0
        for s, c, ids in zip(seqs, counts, emitted, strict=True):
            if s.params.logprobs is not None:  # of each emitted token, at its own row
                want += range(at, at + len(ids))
                tokens += ids
            at += c
        infos = iter(_logprob_infos(logits, want, tokens, params))
        for s, ids in zip(seqs, emitted, strict=True):
            with_info = s.params.logprobs is not None
            out[s.seq_id] = [(t, next(infos) if with_info else None) for t in ids]
        return out

    def _rejection_sample(
        self,
        seqs: list[Sequence],
        counts: list[int],
        row_seqs: list[Sequence],
        masked: torch.Tensor,
    ) -> list[list[int]]:
        """The tokens each sequence emits, for a batch with random sampling (greedy rows use
        the argmax); n-gram drafts are one-hot (no draft probabilities)."""
        device, vocab = masked.device, masked.shape[1]
        params = [s.params for s in row_seqs]
        greedy_rows = torch.tensor([p.is_greedy for p in params], device=device)
        temperature = to_device(
            [1.0 if p.is_greedy else p.temperature for p in params], torch.float32, device
        )
        scaled = masked / temperature[:, None]

        def optional(values, on, dtype):
            return to_device(values, dtype, device) if any(on(v) for v in values) else None

        filtered = atom_kernels.apply_top_k_top_p_min_p(
            scaled,
            optional([p.top_k for p in params], lambda k: k > 0, torch.int64),
            optional([p.top_p for p in params], lambda p: p < 1.0, torch.float32),
            optional([p.min_p for p in params], lambda p: p > 0.0, torch.float32),
        )
        probs = torch.where(greedy_rows[:, None], masked, filtered.softmax(dim=-1))
        drafts = [d for s in seqs for d in s.spec_token_ids]
        num_drafts = len(drafts)
        # Randomness per sequence: from its generator when seeded (the same seed, the same
        # tokens), else from the global one.
        uniform = torch.rand(num_drafts, device=device)
        noise = torch.empty(len(seqs), vocab, device=device).exponential_()
        at = 0
        for i, s in enumerate(seqs):
            k = counts[i] - 1
            if s.generator is not None:
                uniform[at : at + k] = torch.rand(k, device=device, generator=s.generator)
                noise[i].exponential_(generator=s.generator)
            at += k
        cu = torch.tensor([0, *itertools.accumulate(c - 1 for c in counts)], device=device)
        out, num = atom_kernels.rejection_sample(
            probs.float(),
            to_device(drafts, torch.int64, device),
            cu,
            None,
            uniform,
            noise,
            torch.tensor([s.params.is_greedy for s in seqs], device=device),
        )
        return [row[:n] for row, n in zip(out.tolist(), num.tolist(), strict=True)]

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


def _logprob_infos(
    raw_logits: torch.Tensor, rows: list[int], token_ids: list[int], params: list
) -> list[TopLogprobs]:
    """Log-probs of token_ids[j] at raw_logits[rows[j]] (the raw logits: vLLM's default), with
    its rank and the top params[rows[j]].logprobs."""
    if not rows:
        return []
    device = raw_logits.device
    logprobs = torch.log_softmax(raw_logits[rows], dim=-1)
    chosen = torch.tensor(token_ids, device=device)
    chosen_lp = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    ranks = ((logprobs > logprobs.gather(1, chosen[:, None])).sum(dim=1) + 1).tolist()
    n = max(params[r].logprobs for r in rows)
    top_lp, top_ids = logprobs.topk(n, dim=-1) if n else (logprobs[:, :0], chosen[:, None][:, :0])
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    return [
        TopLogprobs(
            token_id=t,
            logprob=chosen_lp[j],
            top_ids=top_ids[j][: params[r].logprobs],
            top_logprobs=top_lp[j][: params[r].logprobs],
            rank=int(ranks[j]),
        )
        for j, (r, t) in enumerate(zip(rows, token_ids, strict=True))
    ]


def _biased(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """`logits` [rows, V] with each row's logit_bias added (a copy), or `logits` itself when no
    row has one; one scatter for the whole batch."""
    rows, cols, values = [], [], []
    for i, s in enumerate(seqs):
        bias = s.params.logit_bias
        if bias:
            rows += [i] * len(bias)
            cols += bias.keys()
            values += bias.values()
    if not rows:
        return logits
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
    return logits.index_put(index, to_device(values, logits.dtype, device), accumulate=True)


def to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, through pinned memory so the copy does not block."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _forced_thinking_end(seq: Sequence, emitted: int, ahead: int = 0) -> int | None:
    """The token a row must sample under its thinking budget, or None: once `thinking_budget`
    tokens are out without the end-of-reasoning marker (and, given `thinking_start_ids`, after
    an output that opened its reasoning with them), the marker's ids one per step. `ahead`: the
    draft tokens before this row (speculative decoding) count as output. Requests with a budget
    are sampled on the host (the engine's `host_sampled`), so the output holds no placeholder."""
    params = seq.params
    if params.thinking_budget is None or emitted < params.thinking_budget:
        return None
    marker = params.thinking_end_ids
    step = emitted - params.thinking_budget
    if step >= len(marker):
        return None
    out = seq.output_token_ids + seq.spec_token_ids[:ahead]
    start = params.thinking_start_ids
    if start and out[: len(start)] != start:
        return None  # the reply did not open a reasoning block: nothing to close
    # Forcing goes on only where the last `step` tokens are the marker's start, forced here, and
    # the output before them holds no marker (the model closed its reasoning itself).
    if step and out[len(out) - step :] != marker[:step]:
        return None
    if _contains(out[: len(out) - step], marker):
        return None
    return marker[step]


def _contains(ids: list[int], marker: list[int]) -> bool:
    first, size = marker[0], len(marker)
    return any(ids[i : i + size] == marker for i in range(len(ids) - size + 1) if ids[i] == first)


@torch.no_grad()
def warm_up_sampling(model, hidden_size: int, dtype, device, max_rows: int) -> None:
    """Run the LM head and the samplers once at one row and at several, plain and filtered
    (top-k / top-p, then min-p too), on the logits as both step paths pass them (the model's
    dtype: `launch`; fp32: `run`) with the engine's parameter dtypes, so the kernels of the
    step's tail (Triton specializes them on these dtypes and on the row count) compile or load
    at start-up, not during the first requests (seconds of a step on a cold Triton cache;
    FlashInfer's sampler module where it is used)."""
    for rows in (1, 2, max(1, max_rows)):
        logits = model.compute_logits(torch.zeros(rows, hidden_size, dtype=dtype, device=device))
        atom_kernels.greedy_argmax(logits)
        temperature = torch.ones(rows, device=device)
        top_k = torch.full((rows,), 50, dtype=torch.int64, device=device)
        top_p = torch.full((rows,), 0.9, device=device)
        for passed in {logits.dtype: logits, torch.float32: logits.float()}.values():
            for filters in ((None, None, None), (top_k, top_p, None), (top_k, top_p, top_p - 0.8)):
                atom_kernels.sample(passed, temperature, *filters)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
