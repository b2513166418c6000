"""The ``l2_prefetch`` op on NVIDIA GPUs: one bulk L2 prefetch a chunk (ops/prefetch.py).

Each thread reads one (address, bytes) row of the table and issues
``cp.async.bulk.prefetch.L2.global``: the SM's TMA unit asks L2 for those lines and the thread
goes on without waiting, so a few hundred threads start tens of MB on their way in about a
microsecond. Bulk prefetch is sm_90+ PTX; elsewhere (older GPUs, ROCm, Triton's interpreter,
which runs no inline PTX) the launcher does nothing, as the torch reference.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_kernels.backends.triton.common import is_interpreted
from atom_kernels.registry import register_op

BLOCK = 32  # table rows a program (one warp, a row a thread)

# $1 the address (16-byte aligned), $2 the bytes (a multiple of 16; 0: nothing, a masked row).
_ASM = tl.constexpr(
    "{\n.reg .pred p;\nsetp.ne.u32 p, $2, 0;\n"
    "@p cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;\n}"
)
# The same with the lines marked evict-last in L2 (what streams past them goes first).
_ASM_EVICT_LAST = tl.constexpr(
    "{\n.reg .pred p;\n.reg .b64 policy;\nsetp.ne.u32 p, $2, 0;\n"
    "createpolicy.fractional.L2::evict_last.b64 policy, 1.0;\n"
    "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;\nmov.u32 $0, 0;\n}"
)


@triton.jit
def _l2_prefetch_kernel(spans_ptr, n, BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < n
    address = tl.load(spans_ptr + 2 * rows, mask=mask, other=0)
    size = tl.load(spans_ptr + 2 * rows + 1, mask=mask, other=0).to(tl.int32)
    tl.inline_asm_elementwise(_ASM_EVICT_LAST if EVICT_LAST else _ASM, "=r,l,r", [address, size],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


@functools.cache
def _bulk_prefetch(index: int) -> bool:
    return torch.version.hip is None and torch.cuda.get_device_capability(index)[0] >= 9


def supported(device: torch.device) -> bool:
    """Whether ``l2_prefetch`` issues anything on ``device`` (an sm_90+ NVIDIA GPU)."""
    if device.type != "cuda" or is_interpreted(device):
        return False
    return _bulk_prefetch(device.index if device.index is not None else torch.cuda.current_device())


@register_op("l2_prefetch", "triton")
def l2_prefetch(spans: torch.Tensor, evict_last: bool = False) -> None:
    if not supported(spans.device):
        return
    n = spans.shape[0]
    _l2_prefetch_kernel[(triton.cdiv(n, BLOCK),)](spans, n, BLOCK=BLOCK, EVICT_LAST=evict_last,
                                                   num_warps=1)  # fmt: skip
