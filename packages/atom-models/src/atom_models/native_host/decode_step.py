"""The CPU's decode-only step plan (`atom_kernels.backends.cpu.decode_step.DecodeStep`) for
`NativeAttention`: built once a step from its `PagedAttentionMetadata` by the first layer, kept in
the metadata's `memo`, taken by every later layer of the step whose cache and window match
(`NativeAttention._decode_step`)."""

from __future__ import annotations

import torch

from atom_kernels.registry import get_op


def _step_tensors(md) -> tuple[torch.Tensor, ...]:
    return md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc


def versions_of(md) -> tuple[int, ...]:
    """The metadata tensors' versions (a plan holds for them unmodified only)."""
    return tuple(t._version for t in _step_tensors(md))


def build_decode_step(md, q, block_size, spec):
    """(the CPU's DecodeStep for this step, the metadata's versions), or False where the step or
    the backend is not one it serves (the checked ops then run every layer)."""
    # NOTE: only where the cpu backend is the one selected (ATOM_KERNEL_BACKEND=torch keeps the
    # reference on every layer): DecodeStep is that backend's decode path, minus its per-call
    # Python (its module NOTE has the measurements).
    op = get_op("paged_attention", q.device)
    if getattr(op, "__module__", "") != "atom_kernels.backends.cpu.attention":
        return False
    if md.query_lens_cpu is not None and any(n != 1 for n in md.query_lens_cpu):
        return False
    if md.slot_mapping.shape[0] != q.shape[0] or md.seq_lens.shape[0] != q.shape[0]:
        return False  # padding rows, or sequences with no row
    from atom_kernels.backends.cpu.decode_step import DecodeStep

    try:
        step = DecodeStep.build(
            md.slot_mapping, md.block_tables, md.seq_lens, block_size, spec.sliding_window
        )
    except ValueError:
        return False  # the checked ops say what is wrong
    return step, versions_of(md)
