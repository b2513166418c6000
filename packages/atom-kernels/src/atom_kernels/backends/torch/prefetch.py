"""The L2 prefetch's reference: a prefetch changes no value, so it does nothing."""

from __future__ import annotations

import torch

from atom_kernels.registry import register_op


@register_op("l2_prefetch", "torch")
def l2_prefetch(spans: torch.Tensor, evict_last: bool = False) -> None:
    return None
