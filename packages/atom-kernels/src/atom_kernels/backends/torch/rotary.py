"""Torch reference: rotary position embedding (and the same followed by the KV-cache write)."""

from __future__ import annotations

import torch

from atom_kernels.backends.torch.cache import reshape_and_cache
from atom_kernels.backends.torch.norm import rms_norm
from atom_kernels.registry import register_op


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, 1, R/2] fp32
    rotary_dim = 2 * cos.shape[-1]
    x_rot = x[..., :rotary_dim].float()
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox:
        rotated = torch.cat((o1, o2), dim=-1)
    else:
        rotated = torch.stack((o1, o2), dim=-1).flatten(-2)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


@register_op("rotary_embedding", "torch")
def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, norm_eps), rms_norm(k, k_norm_weight, norm_eps)
    cos_sin = cos_sin_cache[positions.long()].float()  # [T, R]
    cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, R/2] each
    return _rotate(q, cos, sin, is_neox), _rotate(k, cos, sin, is_neox)


@register_op("rotary_embedding_and_cache", "torch")
def rotary_embedding_and_cache(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor | None,
    v_scale: float | torch.Tensor | None,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    q, k = rotary_embedding(
        positions, q, k, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight, norm_eps
    )
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return q
