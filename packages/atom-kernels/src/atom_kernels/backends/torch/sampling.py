"""Torch reference: sampling, logprobs, penalties."""

from __future__ import annotations

import torch

from atom_kernels.ops.sampling import SamplerOutput
from atom_kernels.registry import register_op

# vLLM's _SAMPLING_EPS: a temperature below it means greedy.
_SAMPLING_EPS = 1e-5


def _top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab_size = logits.shape[1]
    k = top_k.long()
    active = (k > 0) & (k < vocab_size)
    if not bool(active.any()):
        return logits
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth_value = sorted_desc.gather(1, (k.clamp(1, vocab_size) - 1)[:, None])  # [B, 1]
    return logits.masked_fill((logits < kth_value) & active[:, None], float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    p = top_p.float()[:, None]
    if not bool((p < 1.0).any()):
        return logits
    sorted_probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    # Keep tokens while the mass of the more likely ones is still short of p; the first always.
    drop_sorted = (mass_before >= p) & (p < 1.0)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = min_p.float()[:, None]
    if not bool((threshold > 0).any()):
        return logits
    probs = torch.softmax(logits, dim=-1)
    drop = probs < threshold * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(drop, float("-inf"))


@register_op("apply_top_k_top_p_min_p", "torch")
def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    logits = logits.float()
    if top_k is not None:
        logits = _top_k(logits, top_k)
    if top_p is not None:
        logits = _top_p(logits, top_p)
    if min_p is not None:
        logits = _min_p(logits, min_p)
    return logits


@register_op("greedy_argmax", "torch")
def greedy_argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    if out is None:
        return logits.argmax(dim=-1)
    return torch.argmax(logits, dim=-1, out=out)


@register_op("sample", "torch")
def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    generators: list[torch.Generator | None] | None,
    num_logprobs: int,
) -> SamplerOutput:
    logits = logits.float()
    raw_logprobs = torch.log_softmax(logits, dim=-1)
    token_ids = logits.argmax(dim=-1)  # greedy; ties -> the first (lowest) id
    # Every row is drawn and greedy rows then keep the argmax: no host sync on flags, so a caller
    # can queue its next step before this one's ids are known.
    is_greedy = temperature < _SAMPLING_EPS
    temp = torch.where(is_greedy, torch.ones_like(temperature), temperature).float()
    masked = apply_top_k_top_p_min_p(logits / temp[:, None], top_k, top_p, min_p)
    probs = torch.softmax(masked, dim=-1)
    # Exponential race: argmax(p / E), E ~ Exp(1) i.i.d., draws from p. A seeded row fills its own
    # E from its generator, so its draw does not depend on the other rows.
    noise = torch.empty_like(probs).exponential_()
    for b, g in enumerate(generators or ()):
        if g is not None:
            noise[b].exponential_(generator=g)
    noise.clamp_(min=torch.finfo(noise.dtype).tiny)  # E == 0 would make 0 / 0 = NaN
    sampled = (probs / noise).argmax(dim=-1)
    token_ids = torch.where(is_greedy, token_ids, sampled)
    top_logprobs, top_token_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    return SamplerOutput(
        token_ids=token_ids,
        logprobs=raw_logprobs.gather(1, token_ids[:, None]).squeeze(1),
        top_logprobs=top_logprobs,
        top_token_ids=top_token_ids,
    )


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    ids = token_ids.long()
    ids = torch.where((ids < 0) | (ids >= vocab_size), vocab_size, ids)  # padding -> extra bin
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids))
    return counts[:, :vocab_size]


@register_op("apply_penalties", "torch")
def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    output_token_ids: torch.Tensor,
    presence_penalty: torch.Tensor,
    frequency_penalty: torch.Tensor,
    repetition_penalty: torch.Tensor,
) -> torch.Tensor:
    logits = logits.float()
    vocab_size = logits.shape[1]
    output_counts = _token_counts(output_token_ids, vocab_size)
    output_seen = output_counts > 0
    seen = (_token_counts(prompt_token_ids, vocab_size) > 0) | output_seen
    rep = repetition_penalty.float()[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency_penalty.float()[:, None] * output_counts
    return logits - presence_penalty.float()[:, None] * output_seen
