"""Argument checks shared by the public ops. Metadata only (shape, dtype, device): never a value
check, which would sync the host with the device."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)
FP8_DTYPES = tuple(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_tensor(
    op: str,
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    min_ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(
            f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)} ({t.dim()} dims)"
        )
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{op}: {name} must have at least {min_ndim} dims, got {t.dim()}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}, expected one of {_names(dtypes)}")
    return t


def check_dim(op: str, name: str, t: torch.Tensor, dim: int, expected: int, why: str) -> None:
    if t.shape[dim] != expected:
        want = list(t.shape)
        want[dim] = expected
        raise ValueError(
            f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(want)} {why}".rstrip()
        )


def check_shape(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...], why: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(
            f"{op}: {name} has shape {tuple(t.shape)}, expected {tuple(shape)} {why}".rstrip()
        )


def check_same_device(op: str, ref_name: str, ref: torch.Tensor, **others: object) -> None:
    for name, t in others.items():
        if isinstance(t, torch.Tensor) and t.device != ref.device:
            raise ValueError(
                f"{op}: {name} is on {t.device}, expected {ref.device} (the device of {ref_name})"
            )


def check_same_dtype(op: str, ref_name: str, ref: torch.Tensor, **others: torch.Tensor) -> None:
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise ValueError(
                f"{op}: {name} has dtype {t.dtype}, expected {ref.dtype} (the dtype of {ref_name})"
            )


def check_scale(op: str, name: str, scale: object, ref: torch.Tensor) -> None:
    """A per-tensor scale: a positive number, or a one-element float tensor on ref's device."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"{op}: {name} must be per-tensor (one element), got shape {tuple(scale.shape)}"
            )
        if not scale.dtype.is_floating_point:
            raise ValueError(f"{op}: {name} has dtype {scale.dtype}, expected a float dtype")
        check_same_device(op, "the cache", ref, **{name: scale})
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        if not scale > 0:
            raise ValueError(f"{op}: {name} must be > 0, got {scale}")
    else:
        raise ValueError(f"{op}: {name} must be a float or a one-element tensor, got {scale!r}")


def check_batch_layout(
    op: str, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> int:
    """A paged batch's block_tables [B, M], seq_lens [B] and query_start_loc [B + 1]; B."""
    check_tensor(op, "block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES)
    check_tensor(op, "seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES)
    check_tensor(op, "query_start_loc", query_start_loc, ndim=1, dtypes=INDEX_DTYPES)
    num_seqs = block_tables.shape[0]
    check_shape(op, "seq_lens", seq_lens, (num_seqs,), "(one per row of block_tables)")
    check_shape(op, "query_start_loc", query_start_loc, (num_seqs + 1,), "(B + 1 offsets)")
    return num_seqs


def check_max_query_len(op: str, max_query_len: object) -> None:
    if max_query_len is not None and (
        not isinstance(max_query_len, int) or isinstance(max_query_len, bool) or max_query_len < 0
    ):
        raise ValueError(
            f"{op}: max_query_len must be a non-negative int or None, got {max_query_len!r}"
        )


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES
