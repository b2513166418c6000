"""CPU: a float32 linear layer whose weight MKL packs once, for the row counts it is used at.

NOTE: SmolLM2's tied LM head (49152 x 576 float32, 113 MB) on this 2-core AMD EPYC (AVX2, 1
thread; issue 21): `F.linear` took 9.7 ms at 1 row and 24.9 ms at 8, the weight packed for that
row count (`mkl._mkl_reorder_linear_weight`) 5.2 and 20.5 ms. A packed weight serves only its own
row count (MKL's packed format is laid out for one M), so each count costs a copy of the weight;
every other count runs `F.linear`. The decoder's smaller projections gained ~10% at 1 row and
~3% at 8 from packing (30 layers, 425 MB, streamed from memory), not worth a copy each.
NOTE: at 8 rows oneDNN's packed weight (`onednn_linear`, one copy for 2-16 rows) beat MKL's: the
same head, 1 thread, load ~2.4 with other jobs, two repeats each: `F.linear` 52-53 ms, MKL-packed
for 8 rows 48-51 ms, oneDNN-packed 26-30 ms; at 1 row MKL's stays best (8.5-8.7 ms against
`F.linear`'s 16-17 and oneDNN's 15-17). So `onednn=True` packs the oneDNN copy too, which
serves its row counts wherever MKL has no copy of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.backends.cpu import onednn_linear


def can_pack(weight: torch.Tensor) -> bool:
    """Whether MKL can pack `weight` here (a float32 CPU matrix, a build with MKL)."""
    return (
        torch.backends.mkl.is_available()
        and hasattr(torch.ops.mkl, "_mkl_linear")
        and weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
    )


class PackedLinear:
    """x [M, K] -> x @ weight.T [M, N], as `F.linear(x, weight)`; MKL-packed at `rows`."""

    def __init__(self, weight: torch.Tensor, rows: tuple[int, ...], onednn: bool = False) -> None:
        if not can_pack(weight):
            raise ValueError("PackedLinear needs a float32 CPU weight and torch built with MKL")
        self.weight = weight
        self.packed = {m: torch.ops.mkl._mkl_reorder_linear_weight(weight, m) for m in rows}
        self.onednn_key = self.onednn_packed = None
        if onednn and onednn_linear.can_pack(weight):
            self.onednn_key, self.onednn_packed = onednn_linear.pack(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.packed.get(x.shape[0]) if x.dim() == 2 and x.dtype == torch.float32 else None
        if packed is not None:
            return torch.ops.mkl._mkl_linear(x.contiguous(), packed, self.weight, None, x.shape[0])
        if self.onednn_key is not None:  # its own row counts, F.linear at the others
            return onednn_linear.packed_linear(x, self.weight, None, self.onednn_key)
        return F.linear(x, self.weight)
