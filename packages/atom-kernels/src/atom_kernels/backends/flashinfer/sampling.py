"""Top-k / top-p sampling by FlashInfer's rejection sampler (no sort, no threshold search).

The same draw as ``sampling_filter.filtered_sample`` for rows without min-p: each row from its
tempered logits after top-k, then top-p on what top-k kept (FlashInfer's ``top_k_first``), except
that tokens tied with the last one top-p keeps are all kept (the reference cuts such a tie);
greedy rows (temperature below ``_SAMPLING_EPS``) are the raw argmax; the log-prob is the raw
distribution's. Unseeded rows only: FlashInfer draws from the global CUDA generator.
"""

from __future__ import annotations

import torch

from atom_kernels.backends.torch.sampling import _SAMPLING_EPS


def filtered_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_ids [B] int64, their raw log-probs [B] fp32)."""
    from flashinfer.sampling import top_k_top_p_sampling_from_logits

    rows, vocab = logits.shape
    raw = logits.float()
    greedy = temperature < _SAMPLING_EPS
    tempered = raw / torch.where(greedy, 1.0, temperature.float())[:, None]
    if top_k is None:
        k = torch.full((rows,), vocab, dtype=torch.int32, device=logits.device)
    else:  # ATOM's "off": 0 or >= the vocabulary (or negative); FlashInfer's: the vocabulary
        k = torch.where((top_k <= 0) | (top_k > vocab), vocab, top_k).to(torch.int32)
    p = torch.ones(rows, device=logits.device) if top_p is None else top_p.float()
    drawn = top_k_top_p_sampling_from_logits(tempered, k, p, deterministic=True)
    token_ids = torch.where(greedy, raw.argmax(dim=-1), drawn.long())
    logprobs = raw.gather(1, token_ids[:, None]).squeeze(1) - torch.logsumexp(raw, dim=-1)
    return token_ids, logprobs
