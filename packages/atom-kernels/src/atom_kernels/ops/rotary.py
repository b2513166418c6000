"""Rotary position embedding applied to q and k (neox and gptj styles, partial rotary), alone or
with the rotated k and v written into the paged KV cache."""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from atom_kernels.ops.cache import check_paged_cache
from atom_kernels.registry import get_op


def _check_rotary(
    op: str,
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    norm_eps: float,
) -> None:
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
    _check_rotary(op, positions, q, k, cos_sin_cache, q_norm_weight, k_norm_weight, norm_eps)
    return get_op(op, q.device)(
        positions, q, k, cos_sin_cache, bool(is_neox), q_norm_weight, k_norm_weight, norm_eps
    )


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
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    *,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    norm_eps: float = 1e-6,
) -> torch.Tensor:
    """``rotary_embedding`` then ``reshape_and_cache`` of the rotated k and v, as one op: returns
    the rotated q [T, H, D]; the rotated k and v go into the paged cache, in place.

    positions, q, k, cos_sin_cache, is_neox, q_norm_weight, k_norm_weight, norm_eps: as
    ``rotary_embedding`` (k's head dim equals q's here); v, key_cache, value_cache, slot_mapping
    (-1 = padding: nothing cached), k_scale, v_scale: as ``reshape_and_cache``. The values are
    rounded as the two ops round them (the rotated k to k's dtype, then to the cache's). On the
    Triton backend it is one launch (``backends/triton/rotary_cache.py``).
    """
    op = "rotary_embedding_and_cache"
    _check_rotary(op, positions, q, k, cos_sin_cache, q_norm_weight, k_norm_weight, norm_eps)
    check_tensor(op, "v", v, ndim=3, dtypes=FLOAT_DTYPES)
    check_tensor(op, "slot_mapping", slot_mapping, ndim=1, dtypes=INDEX_DTYPES)
    check_same_dtype(op, "q", q, v=v)
    check_paged_cache(op, key_cache, value_cache, k_scale, v_scale)
    num_tokens, num_kv_heads = q.shape[0], key_cache.shape[2]
    check_shape(
        op, "k", k, (num_tokens, num_kv_heads, key_cache.shape[3]), "to match key_cache's (Hk, D)"
    )
    check_shape(
        op,
        "v",
        v,
        (num_tokens, num_kv_heads, value_cache.shape[3]),
        "to match q's T and value_cache's (Hk, Dv)",
    )
    check_dim(op, "slot_mapping", slot_mapping, 0, num_tokens, "(one slot per token)")
    check_same_device(
        op, "q", q, v=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping
    )
    return get_op(op, q.device)(
        positions, q, k, v, cos_sin_cache, bool(is_neox), key_cache, value_cache, slot_mapping,
        k_scale, v_scale, q_norm_weight, k_norm_weight, norm_eps,
    )  # fmt: skip
