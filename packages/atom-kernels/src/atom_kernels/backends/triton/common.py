"""Launch helpers shared by the Triton kernels: block sizes, warps, per-tensor scales, SM count."""

from __future__ import annotations

import functools

import torch
import triton

# Widest row a one-block-per-row kernel (norms) keeps in registers; wider rows go to the torch
# reference. Liger-Kernel and Unsloth use the same 64K bound.
MAX_FUSED_SIZE = 65536


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(max(1, n)))


def row_num_warps(block: int) -> int:
    """Warps for a kernel that keeps one row of ``block`` elements in registers (Liger's rule)."""
    if block >= 32768:
        return 16
    if block >= 8192:
        return 8
    if block >= 2048:
        return 4
    return 2 if block >= 512 else 1


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] as a 2-D [M, N] view when the leading dims merge (a copy otherwise)."""
    return x.reshape(-1, x.shape[-1])


def is_interpreted(device: torch.device) -> bool:
    """Kernels launched on CPU tensors run in Triton's interpreter (TRITON_INTERPRET=1)."""
    return device.type == "cpu"


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on ROCm) of ``device``; 4 under the CPU interpreter."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


def scale_args(
    scale: float | torch.Tensor | None, dummy: torch.Tensor
) -> tuple[torch.Tensor, float, bool]:
    """A per-tensor scale as kernel arguments (pointer, float, is-pointer).

    A tensor scale is read inside the kernel (no host sync, CUDA-graph safe); a float travels by
    value; None means 1.0. ``dummy`` stands in for the pointer when there is none.
    """
    if isinstance(scale, torch.Tensor):
        return scale, 1.0, True
    return dummy, 1.0 if scale is None else float(scale), False


# Counters of the kernels whose last program on a tile finishes it (split-K GEMM, decode
# attention's split merge): zero between kernels, since each such program sets its counter back
# to zero. One buffer per device, shared by every kernel on the device's stream; a grown buffer
# replaces the old one, which stays alive (a captured CUDA graph may still point at it).
MIN_COUNTERS = 1 << 16
_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor | None:
    """At least ``count`` zeroed int32 counters on ``device``, or None while a CUDA graph is
    being captured and the buffer would have to grow (a zeroing recorded in a graph does not run
    until the graph replays): the caller then takes its path without counters."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(count, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of a cache dtype (0 for non-fp8: unused)."""
    return float(torch.finfo(dtype).max) if dtype.itemsize == 1 else 0.0
