"""Rotary position embedding over flattened q/k ([T, heads * head_size])."""

from __future__ import annotations

import json

import torch
from torch import nn

import atom_kernels


def rope_parameters(config) -> tuple[float, dict | None]:
    """(base, scaling dict or None) from an HF config, transformers 4.x or 5.x style."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(base), (dict(params) if kind != "default" else None)
    scaling = getattr(config, "rope_scaling", None)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    return float(getattr(config, "rope_theta", 10000.0)), (
        dict(scaling) if scaling and kind != "default" else None
    )


def partial_rotary_factor(config) -> float:
    """The fraction of each head rotated: a config field (transformers 4.x) or a key of
    `rope_parameters` (transformers 5.x, e.g. GLM-4-MoE)."""
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    return 1.0 if factor is None else float(factor)


def _cache_length(max_position: int, rope_scaling: dict | None) -> int:
    """How many positions the cos/sin cache must cover for this scaling type."""
    if not rope_scaling:
        return max_position
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    factor = float(rope_scaling.get("factor", 1.0))
    if kind in ("linear", "dynamic"):
        return int(max_position * factor)
    if kind == "yarn" and rope_scaling.get("original_max_position_embeddings"):
        return max(max_position, int(rope_scaling["original_max_position_embeddings"] * factor))
    return max_position


# The cos/sin caches built so far, by their arguments: every layer of a model shares one (built
# once, not once per layer: 94 times 40,960 positions took ~30 s of a Qwen3-235B start on 4
# ranks). Never written: a rank's materializer copies it to the device once for all the layers.
_COS_SIN_CACHES: dict[tuple, torch.Tensor] = {}
_MAX_CACHES = 8


def shared_cos_sin_cache(
    rotary_dim: int, length: int, base: float, rope_scaling: dict | None
) -> torch.Tensor:
    """`rope_cos_sin_cache` (fp32, CPU) for these arguments, built once per process."""
    key = (rotary_dim, length, float(base), json.dumps(rope_scaling, sort_keys=True, default=repr))
    cache = _COS_SIN_CACHES.get(key)
    if cache is None:
        # Built for real on the CPU even while the model is built on `meta`: it is computed, not
        # loaded; the materializer moves it to the model's device and keeps it in fp32.
        with torch.device("cpu"):
            cache = atom_kernels.rope_cos_sin_cache(
                rotary_dim, length, base, rope_scaling, dtype=torch.float32, device="cpu"
            )
        if len(_COS_SIN_CACHES) >= _MAX_CACHES:
            _COS_SIN_CACHES.pop(next(iter(_COS_SIN_CACHES)))
        _COS_SIN_CACHES[key] = cache
    return cache


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict | None = None,
        is_neox: bool = True,
    ) -> None:
        super().__init__()
        self.head_size, self.rotary_dim, self.is_neox = head_size, rotary_dim, is_neox
        length = _cache_length(max_position, rope_scaling)
        cache = shared_cos_sin_cache(rotary_dim, length, base, rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k; with q_norm / k_norm (per-head RMSNorms, as Qwen3's), normalize each
        head first in the same kernel."""
        # T = tokens
        num_tokens = q.shape[0]
        norms = {}
        if q_norm is not None:
            norms = dict(
                q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, norm_eps=q_norm.eps
            )
        q, k = atom_kernels.rotary_embedding(
            positions,
            q.view(num_tokens, -1, self.head_size),  # [T, H, D]
            k.view(num_tokens, -1, self.head_size),  # [T, Hk, D]
            self.cos_sin_cache,
            self.is_neox,
            **norms,
        )
        return q.reshape(num_tokens, -1), k.reshape(num_tokens, -1)


def get_rope(
    head_size: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    partial_rotary_factor: float = 1.0,
    is_neox: bool = True,
) -> RotaryEmbedding:
    rotary_dim = int(head_size * partial_rotary_factor)
    return RotaryEmbedding(head_size, rotary_dim, max_position, base, rope_scaling, is_neox)
