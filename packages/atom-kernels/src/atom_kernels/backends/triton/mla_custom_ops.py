"""The Triton MLA ops as torch custom ops ("atom::triton_mla_*") with fake (meta) implementations,
and their eager entries; ``custom_ops`` routes the registry's entries to them (see there)."""

from __future__ import annotations

import torch

from atom_kernels.backends.triton import mla_attention, mla_cache


@torch.library.custom_op(
    "atom::triton_mla_cache_write",
    mutates_args=("kv_cache",),
    schema="(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, "
    "Tensor? kv_scale=None, float? kv_scale_value=None) -> ()",
)
def _mla_cache_write_op(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None, kv_scale_value=None):
    scale = kv_scale if kv_scale is not None else kv_scale_value
    mla_cache.mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, scale)


@_mla_cache_write_op.register_fake
def _(kv_c, k_pe, kv_cache, slot_mapping, *scale):
    return None


def _split_scale(scale: float | torch.Tensor | None) -> tuple[torch.Tensor | None, float | None]:
    """A per-tensor scale as the two custom-op arguments (see custom_ops)."""
    if isinstance(scale, torch.Tensor):
        return scale, None
    return None, None if scale is None else float(scale)


def mla_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: float | torch.Tensor | None = None,
) -> None:
    """Through the custom op (the traced entry)."""
    _mla_cache_write_op(kv_c, k_pe, kv_cache, slot_mapping, *_split_scale(kv_scale))


@torch.library.custom_op(
    "atom::triton_mla_paged_attention",
    mutates_args=("out",),
    schema="(Tensor q_latent, Tensor q_pe, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start_loc, float scale, Tensor(a!) out, int? max_query_len=None, "
    "Tensor? kv_scale=None, float? kv_scale_value=None) -> ()",
)
def _mla_paged_attention_op(
    q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
    max_query_len=None, kv_scale=None, kv_scale_value=None,
):  # fmt: skip
    mla_attention.mla_paged_attention(
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
        kv_scale=kv_scale if kv_scale is not None else kv_scale_value,
        max_query_len=max_query_len,
    )  # fmt: skip


@_mla_paged_attention_op.register_fake
def _(q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out, *rest):
    return None


def _attention_out(q_latent: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, or a new contiguous [T, H, L] tensor when None."""
    if out is not None:
        return out
    return torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)


def mla_paged_attention(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    max_query_len: int | None = None,
    kv_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Through the custom op (the traced entry)."""
    out = _attention_out(q_latent, out)
    _mla_paged_attention_op(
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
        max_query_len, *_split_scale(kv_scale),
    )  # fmt: skip
    return out


def mla_paged_attention_direct(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None,
    max_query_len: int | None = None,
    kv_scale: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """The same Triton host code without the custom-op dispatch (the eager entry)."""
    out = _attention_out(q_latent, out)
    return mla_attention.mla_paged_attention(
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
        kv_scale=kv_scale, max_query_len=max_query_len,
    )  # fmt: skip
