"""The Triton MLA ops as torch custom ops ("atom::triton_mla_*") with fake (meta) implementations,
and their eager entries; ``custom_ops`` routes the registry's entries to them (see there)."""

from __future__ import annotations

import torch

from atom_kernels.backends.triton import mla_attention, mla_cache


@torch.library.custom_op(
    "atom::triton_mla_cache_write",
    mutates_args=("kv_cache",),
    schema="(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()",
)
def mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping):
    mla_cache.mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping)


@mla_cache_write.register_fake
def _(kv_c, k_pe, kv_cache, slot_mapping):
    return None


@torch.library.custom_op(
    "atom::triton_mla_paged_attention",
    mutates_args=("out",),
    schema="(Tensor q_latent, Tensor q_pe, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, "
    "Tensor query_start_loc, float scale, Tensor(a!) out, int? max_query_len=None) -> ()",
)
def _mla_paged_attention_op(
    q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
    max_query_len=None,
):  # fmt: skip
    mla_attention.mla_paged_attention(
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
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
) -> torch.Tensor:
    """Through the custom op (the traced entry)."""
    out = _attention_out(q_latent, out)
    _mla_paged_attention_op(
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
        max_query_len,
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
) -> torch.Tensor:
    """The same Triton host code without the custom-op dispatch (the eager entry)."""
    out = _attention_out(q_latent, out)
    return mla_attention.mla_paged_attention(
        q_latent, q_pe, kv_cache, block_tables, seq_lens, query_start_loc, scale, out,
        max_query_len=max_query_len,
    )  # fmt: skip
