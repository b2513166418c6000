"""Torch reference: rejection sampling of draft tokens (see atom_kernels.ops.spec_decode)."""

from __future__ import annotations

import torch

from atom_kernels.registry import register_op


def _draw(weights: torch.Tensor, noise: torch.Tensor) -> int:
    """A draw from weights / sum(weights) by the exponential race; the lowest id on ties."""
    return int(torch.argmax(weights / noise).item())


@register_op("rejection_sample", "torch")
def rejection_sample(
    target_probs, draft_token_ids, cu_num_draft, draft_probs, uniform, noise, greedy
):
    cu = cu_num_draft.tolist()
    batch = len(cu) - 1
    max_k = max(cu[i + 1] - cu[i] for i in range(batch))
    out = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=target_probs.device)
    num_emitted = torch.zeros(batch, dtype=torch.int32, device=target_probs.device)
    for i in range(batch):
        start, k = cu[i], cu[i + 1] - cu[i]
        rows = target_probs[start + i : start + i + k + 1]
        emitted = []
        for j in range(k):
            x, p = int(draft_token_ids[start + j]), rows[j]
            if bool(greedy[i]):
                best = int(torch.argmax(p).item())
                if best != x:
                    emitted.append(best)
                    break
            else:
                q_x = 1.0 if draft_probs is None else float(draft_probs[start + j, x])
                if not float(uniform[start + j]) * q_x < float(p[x]):
                    if draft_probs is None:
                        residual = p.clone()
                        residual[x] = 0.0
                    else:
                        residual = (p - draft_probs[start + j]).clamp(min=0.0)
                    emitted.append(_draw(residual, noise[i]))
                    break
            emitted.append(x)
        else:  # every draft accepted: the bonus token
            p = rows[k]
            emitted.append(int(torch.argmax(p).item()) if bool(greedy[i]) else _draw(p, noise[i]))
        out[i, : len(emitted)] = torch.tensor(emitted)
        num_emitted[i] = len(emitted)
    return out, num_emitted
