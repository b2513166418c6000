"""Weights asked of the GPU's L2 cache ahead of the kernel that reads them.

A batch-1 decode layer reads its weights in four GEMMs; between them run kernels that read
almost nothing from DRAM (the rotary and K/V cache write, the attention at short contexts, the
norms). ``l2_prefetch`` fills such a window: started on a side stream as the attention begins,
it asks L2 for the leading bytes of the GEMMs after it (the output projection, the MLP's first
GEMM) and returns at once, so those GEMMs find part of their weights in L2 instead of DRAM.

A prefetch is a hint: it reads nothing back and changes no value, so the torch reference does
nothing, and a backend may ignore it. The Triton backend issues one bulk prefetch
(``cp.async.bulk.prefetch.L2``, sm_90+) a chunk on NVIDIA GPUs and does nothing elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from atom_kernels.registry import get_op

CHUNK_BYTES = 8192  # bytes a bulk prefetch asks for (a multiple of 16)


def l2_spans(groups: Sequence[Sequence[torch.Tensor]], budget: int) -> torch.Tensor:
    """The chunks ``l2_prefetch`` asks for: int64 [C, 2] of (address, bytes), on the tensors'
    device. ``groups`` are the tensors of each module (a layer's weights, scales, zeros) in the
    order their kernels run; each group in turn takes what is left of ``budget`` bytes, and a
    group that does not fit whole takes the same leading fraction of each of its tensors (a
    GEMM's first rows and their scales). Chunks are 16-byte aligned, each at most CHUNK_BYTES."""
    chunks: list[tuple[int, int]] = []
    left = max(int(budget), 0)
    device = None
    for group in groups:
        tensors = [t for t in group if t.numel()]
        total = sum(t.numel() * t.element_size() for t in tensors)
        if not total or left <= 0:
            continue
        fraction = min(1.0, left / total)
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError(f"l2_spans: tensor of shape {tuple(t.shape)} is not contiguous")
            device = t.device
            nbytes = int(t.numel() * t.element_size() * fraction)
            start, end = t.data_ptr() & -16, (t.data_ptr() + nbytes + 15) & -16
            chunks.extend((a, min(CHUNK_BYTES, end - a)) for a in range(start, end, CHUNK_BYTES))
        left -= int(total * fraction)
    return torch.tensor(chunks, dtype=torch.int64, device=device).reshape(-1, 2)


def l2_prefetch(spans: torch.Tensor, evict_last: bool = False) -> None:
    """Ask L2 for the chunks of ``spans`` (``l2_spans``'s table); returns before they arrive.
    ``evict_last``: the lines marked evict-last in L2 (evicted after the lines streaming past
    them), where the backend can say so."""
    if spans.dtype != torch.int64 or spans.ndim != 2 or spans.shape[1] != 2:
        raise ValueError(
            f"l2_prefetch: spans must be int64 [C, 2], got {spans.dtype} {tuple(spans.shape)}"
        )
    if not spans.is_contiguous():
        raise ValueError("l2_prefetch: spans must be contiguous")
    if spans.shape[0]:
        get_op("l2_prefetch", spans.device)(spans, bool(evict_last))
