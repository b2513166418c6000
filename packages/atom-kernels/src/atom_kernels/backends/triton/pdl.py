"""Programmatic dependent launch (PDL, Hopper and newer) for the weight-streaming decode kernels.

A kernel launched with PDL may start while the kernel before it in the stream is still running;
before it reads anything that kernel wrote, or writes anything at all, it must pass
``griddepcontrol.wait``, which returns once the earlier kernel has finished and its writes are
visible. The skinny GEMMs use the window in between: each program first asks L2 for the start of
its weight rows, which no kernel writes, so a batch-1 decode step's weight stream starts during
the previous kernel's tail instead of after it (CUTLASS's "GEMM with weight prefetch" does the
same). After the wait a kernel lets its own dependents launch
(``griddepcontrol.launch_dependents``), so at most one kernel waits ahead of the one running.
In a kernel launched without PDL these instructions are no-ops, and a kernel launched normally
after a PDL kernel waits for it as stream order says: only kernels that call
``wait_for_previous`` before their first read or write may take PDL.

``ATOM_PDL=0`` turns it off; ``ATOM_PDL_PREFETCH_LINES`` sets the 128-byte lines of each weight
row asked for before the wait (default 8).

NOTE (benchmarks/env_ab.sh, since folded into decode_ab.sh; one H100, triton 3.6, torch 2.11,
2026-11-24, results/s11-h100/pdl-call2, two rounds alternating): decode steps at batch 1 / 8,
off against on: Llama-3-8B 6.044, 6.042 / 6.370, 6.360 ms against 6.019, 6.020 / 6.366, 6.334;
Qwen3-0.6B 1.342, 1.346 / 1.613, 1.619 against 1.341, 1.349 / 1.591, 1.593. 32 lines instead of 8
were slower (6.18 ms).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.triton.common import is_interpreted

ENABLED = envs.ATOM_PDL  # read once, at import (tests set ENABLED)
PREFETCH_LINES = envs.ATOM_PDL_PREFETCH_LINES
LINE_BYTES = 128


@functools.cache
def _supported(index: int) -> bool:
    if torch.version.hip is not None:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(cuda, "gdc_wait")


def enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (see the module docstring)."""
    if not ENABLED or device.type != "cuda" or is_interpreted(device):
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def line_elements(weight: torch.Tensor) -> int:
    """Elements of ``weight`` in one 128-byte line (the prefetch stride)."""
    return max(1, LINE_BYTES // weight.element_size())


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the lines at ``ptrs`` (a tensor of addresses); nothing is returned or kept."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def wait_for_previous():
    """Wait until the kernel before this one has finished (its writes visible), then let the
    next PDL kernel launch."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_rows(w_ptr, rows, stride_wn, k_lo, K, LINE: tl.constexpr, LINES: tl.constexpr):
    """Prefetch the first LINES lines (from column k_lo) of the weight rows ``rows`` [BLOCK_N]."""
    cols = tl.minimum(k_lo + tl.arange(0, LINES) * LINE, K - 1)
    prefetch_l2(w_ptr + rows[:, None] * stride_wn + cols[None, :])


@triton.jit
def prefetch_rows_then_wait(
    w_ptr, rows, stride_wn, k_lo, K, LINE: tl.constexpr, LINES: tl.constexpr
):
    """`prefetch_rows`, then `wait_for_previous`."""
    prefetch_rows(w_ptr, rows, stride_wn, k_lo, K, LINE, LINES)
    wait_for_previous()
