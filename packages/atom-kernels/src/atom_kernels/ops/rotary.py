"""Rotary position embedding applied to q and k (neox and gptj styles, partial rotary)."""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_same_device,
    check_same_dtype,
    check_tensor,
)
from atom_kernels.registry import get_op


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first R dims of every q and k head by the angles of their token's position.

    T = tokens, H = query heads, Hk = kv heads, D = head dim, P = cached positions, R = rotary dim.
    positions: [T] int64/int32 (rows of the cache); q: [T, H, D]; k: [T, Hk, D'] (same dtype as
    q); cos_sin_cache: [P, R] from ``rope_cos_sin_cache`` (R even, R <= D and D'). Dims R..D pass
    through. ``is_neox``: rotate halves (x[:R/2], x[R/2:]) as HF Llama; otherwise rotate
    interleaved pairs (x[2i], x[2i+1]) as GPT-J. Returns new (q, k); math in fp32.

    ``q_norm_weight`` [D] / ``k_norm_weight`` [D'] (both or neither): first RMSNorm every head of
    q / k over its head dim with these weights and ``norm_eps`` (Qwen3's q/k norm), rounding as
    ``rms_norm`` does, in the same pass.
    """
    op = "rotary_embedding"
    check_tensor(op, "positions", positions, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(op, "q", q, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "k", k, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "cos_sin_cache", cos_sin_cache, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens = positions.shape[0]
    check_dim(op, "q", q, 0, num_tokens, "(one row per position)")
    check_dim(op, "k", k, 0, num_tokens, "(one row per position)")
    check_same_dtype(op, "q", q, k=k)
    check_same_device(op, "q", q, positions=positions, k=k, cos_sin_cache=cos_sin_cache)
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2:
        raise ValueError(
            f"{op}: cos_sin_cache's last dim (rotary dim) must be even, got {rotary_dim}"
        )
    for name, t in (("q", q), ("k", k)):
        if t.shape[2] < rotary_dim:
            raise ValueError(
                f"{op}: {name} has head dim {t.shape[2]}, smaller than the rotary dim {rotary_dim} "
                "of cos_sin_cache"
            )
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError(f"{op}: give both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is not None:
        weights = (("q_norm_weight", q_norm_weight, q), ("k_norm_weight", k_norm_weight, k))
        for name, w, t in weights:
            check_tensor(op, name, w, ndim=1, dtypes=FLOAT_DTYPES)
            check_dim(op, name, w, 0, t.shape[2], "(one weight per head dim)")
            check_same_device(op, "q", q, **{name: w})
        if not isinstance(norm_eps, (int, float)) or isinstance(norm_eps, bool) or norm_eps < 0:
            raise ValueError(f"{op}: norm_eps must be a non-negative float, got {norm_eps!r}")
    return get_op(op, q.device)(
        positions, q, k, cos_sin_cache, bool(is_neox), q_norm_weight, k_norm_weight, norm_eps
    )
