"""Speculative decoding: lossless verification of draft tokens by rejection sampling.

Leviathan et al. (2023) / Chen et al. (2023): with target distribution p and draft distribution
q at each draft position, draft token x is accepted with probability min(1, p(x) / q(x)); at the
first rejection a token is drawn from norm(max(0, p - q)) instead and the rest of the drafts are
dropped; when every draft is accepted one more (bonus) token is drawn from p at the position after
them. The emitted tokens then follow p exactly, whatever q is. Deterministic drafts (n-gram prompt
lookup) have a one-hot q: x is accepted with probability p(x) and the recovery distribution is p
without x. Greedy requests accept x iff it is p's argmax and emit the argmax otherwise.

Layout (flattened over a batch of B requests, request i having k_i drafts, D = sum k_i, V vocab):
``cu_num_draft`` [B + 1] int32 prefix sums of k_i; ``draft_token_ids`` [D]; ``draft_probs``
[D, V] or None (one-hot drafts); ``target_probs`` [D + B, V], request i's k_i + 1 rows (one per
draft position, then the bonus position) starting at row ``cu_num_draft[i] + i``; the probabilities
after every sampling transform (temperature, top-k/p, min-p, penalties), rows of greedy requests
may hold anything whose argmax is the greedy token (logits are fine).

Randomness comes in, so that per-request seeds hold: ``uniform`` [D] (U[0, 1)) for the acceptance
tests and ``noise`` [B, V] (Exp(1)) for the one token each request draws (recovery or bonus):
argmax(r / noise) is a draw from r / sum(r) (the exponential race, as the sampler's Gumbel-max).

Returns ``(output_token_ids [B, max k_i + 1] int64, num_emitted [B] int32)``: request i's accepted
drafts then its drawn token in row i, -1 after them; num_emitted[i] = accepted + 1.
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import check_same_device, check_tensor
from atom_kernels.registry import get_op


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    uniform: torch.Tensor,
    noise: torch.Tensor,
    greedy: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    op = "rejection_sample"
    check_tensor(op, "cu_num_draft", cu_num_draft, ndim=1, dtypes=(torch.int32, torch.int64))
    batch = cu_num_draft.shape[0] - 1
    if batch < 1:
        raise ValueError(f"{op}: cu_num_draft must hold B + 1 >= 2 offsets, got {batch + 1}")
    check_tensor(op, "draft_token_ids", draft_token_ids, ndim=1, dtypes=(torch.int32, torch.int64))
    num_drafts = draft_token_ids.shape[0]
    check_tensor(op, "target_probs", target_probs, ndim=2, dtypes=(torch.float32,))
    vocab = target_probs.shape[1]
    if target_probs.shape[0] != num_drafts + batch:
        raise ValueError(
            f"{op}: target_probs must have one row per draft plus one per request "
            f"({num_drafts} + {batch}), got {target_probs.shape[0]}"
        )
    if draft_probs is not None:
        check_tensor(op, "draft_probs", draft_probs, ndim=2, dtypes=(torch.float32,))
        if tuple(draft_probs.shape) != (num_drafts, vocab):
            raise ValueError(
                f"{op}: draft_probs must be [{num_drafts}, {vocab}] (drafts x vocab), got "
                f"{tuple(draft_probs.shape)}"
            )
    check_tensor(op, "uniform", uniform, ndim=1, dtypes=(torch.float32,))
    if uniform.shape[0] != num_drafts:
        raise ValueError(
            f"{op}: uniform must have one value per draft ({num_drafts}), got {uniform.shape[0]}"
        )
    check_tensor(op, "noise", noise, ndim=2, dtypes=(torch.float32,))
    if tuple(noise.shape) != (batch, vocab):
        raise ValueError(
            f"{op}: noise must be [{batch}, {vocab}] (requests x vocab), got {tuple(noise.shape)}"
        )
    check_tensor(op, "greedy", greedy, ndim=1, dtypes=(torch.bool,))
    if greedy.shape[0] != batch:
        raise ValueError(
            f"{op}: greedy must have one flag per request ({batch}), got {greedy.shape[0]}"
        )
    check_same_device(
        op,
        "target_probs",
        target_probs,
        draft_token_ids=draft_token_ids,
        cu_num_draft=cu_num_draft,
        draft_probs=draft_probs,
        uniform=uniform,
        noise=noise,
        greedy=greedy,
    )
    impl = get_op(op, target_probs.device)
    return impl(target_probs, draft_token_ids, cu_num_draft, draft_probs, uniform, noise, greedy)
