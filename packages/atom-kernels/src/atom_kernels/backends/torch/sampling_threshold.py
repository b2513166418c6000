"""Top-k / top-p / min-p as one logit threshold per row, found without sorting the vocabulary.

The torch reference (``sampling.apply_top_k_top_p_min_p``) sorts every row: at a 128K vocabulary
that sort is most of a filtered ``sample`` (issue 42: 1.0-1.1 ms a call at batch 1 and 6.7-7.9 ms
at 256 on one H200, against 0.11-0.59 ms for FlashInfer's sort-free sampler). Each filter keeps
the tokens at or above a value, so a row's kept set is ``x >= max(t_k, t_p, t_m)``:

- top-k: ``t_k`` is the k-th largest value: ``torch.topk`` of ``T >= k`` candidates gives it
  exactly (ties with it kept, as the reference keeps them);
- top-p: over the top-k-filtered distribution, the smallest prefix of the candidates (largest
  first) whose mass reaches p; ``t_p`` is that prefix's last value. It needs only the candidates
  when their mass reaches p, or when they hold the whole top-k set; otherwise ``T`` grows once
  (``CANDIDATES``) and then the reference's sort takes the batch. A token tied with ``t_p``
  outside the prefix is kept (the reference keeps or drops such ties as its sort orders them);
- min-p: ``p >= min_p * p_max`` is ``x >= x_max + log(min_p)`` (the normaliser cancels).

Each step is a pass or two over the row (topk, a masked log-sum-exp, the final mask) and one host
sync to pick ``T``, one to check the candidates sufficed.
"""

from __future__ import annotations

import math

import torch

from atom_kernels.backends.torch import sampling as reference

# Candidates taken per row (at least the batch's largest top-k): the first try, then the second
# when some top-p row's candidates held less than p; past that the reference sorts.
CANDIDATES = (256, 4096)


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """The reference's masking (new fp32 logits, excluded tokens -inf) by per-row thresholds."""
    x = logits.float()
    threshold = thresholds(x, top_k, top_p, min_p)
    if threshold is None:
        return reference.apply_top_k_top_p_min_p(x, top_k, top_p, min_p)
    return x.masked_fill(x < threshold[:, None], float("-inf"))


def thresholds(
    x: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor | None:
    """[B] fp32: each row keeps ``x >= threshold`` (-inf: every token); None where the candidates
    cannot decide (the caller sorts). ``x``: [B, V] fp32."""
    rows, vocab = x.shape
    threshold = torch.full((rows,), float("-inf"), device=x.device)
    if rows == 0:
        return threshold
    k = p = None
    if top_k is not None:
        k = top_k.long()
        k = torch.where((k > 0) & (k < vocab), k, 0)  # 0: off
    if top_p is not None:
        p = top_p.float()
    # One sync: the largest k, and whether any row filters by k or by p.
    flags = torch.stack(
        [
            k.max() if k is not None else torch.zeros((), dtype=torch.long, device=x.device),
            (p < 1.0).any().long() if p is not None else torch.zeros_like(threshold[0]).long(),
        ]
    ).tolist()
    k_max, any_p = flags
    if k_max or any_p:
        for tries, wanted in enumerate(CANDIDATES):
            take = min(vocab, max(k_max, wanted))
            found = _top_k_top_p(x, k, p if any_p else None, take)
            if found is not None:
                threshold = found
                break
            if take >= vocab or tries == len(CANDIDATES) - 1:
                return None
    if min_p is not None:
        # min-p after top-k / top-p: the row's max always survives them, and the normaliser of the
        # filtered probabilities cancels in p >= min_p * p_max.
        m = min_p.float()
        floor = x.amax(dim=-1) + torch.where(m > 0, m.clamp(min=1e-38).log(), -math.inf)
        threshold = torch.maximum(threshold, floor)
    return threshold


def _top_k_top_p(
    x: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None, take: int
) -> torch.Tensor | None:
    """The top-k and top-p thresholds from the ``take`` largest values per row, or None when a
    top-p row's cut may lie past them."""
    values = x.topk(take, dim=-1).values  # [B, take], descending
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    t_k = neg_inf.expand(x.shape[0])
    if k is not None:
        kth = values.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
        t_k = torch.where(k > 0, kth, neg_inf)
    if p is None:
        return t_k
    kept = x >= t_k[:, None]
    # The top-k set's normaliser: it may hold ties with t_k beyond the candidates.
    lse = torch.where(kept, x, neg_inf).logsumexp(dim=-1)
    probs = torch.where(values >= t_k[:, None], (values - lse[:, None]).exp(), 0.0)
    mass = probs.cumsum(dim=-1)
    inside = (mass - probs) < p[:, None]
    inside[:, 0] = True  # the first token always stays
    cut = inside.sum(dim=-1)  # the prefix's length
    t_p = values.gather(1, (cut - 1)[:, None]).squeeze(1)
    filters = p < 1.0
    # Decided: the candidates' mass reaches p (the cut is inside them), or they hold the whole
    # top-k set (nothing past them to keep).
    decided = ~filters | (mass[:, -1] >= p) | (kept.sum(dim=-1) <= take)
    if not bool(decided.all()):
        return None
    return torch.where(filters, torch.maximum(t_k, t_p), t_k)
