"""All-reduce for the small messages of tensor-parallel decode, over peer-mapped buffers.

`PeerAllReduce` holds one staging buffer and one flag array per rank, each mapped into every
other rank's process (CUDA IPC through `torch.multiprocessing`'s tensor sharing, each handle
opened in the reader's device context so peer access is enabled from it), and launches the
one-shot Triton kernel of `backends/triton/peer_all_reduce.py`: one kernel, no NCCL, no
multicast, capturable in CUDA graphs (its state lives on the device). `all_reduce_add_rms_norm`
fuses the residual add and the next RMSNorm into it. Messages it does not take (`fits`) stay
with the host's NCCL.

`reference_all_reduce_add_rms_norm` is the PyTorch reference the kernel is tested against.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence

import torch

from atom_kernels.backends.torch.norm import fused_add_rms_norm

# The most programs of one call (one flag per program and rank); a call runs at most one per SM.
MAX_PROGRAMS = 1024
# Rows one call takes (each program loops over its rows).
MAX_ROWS = 1 << 16
# Widest row (elements): one program holds a row in registers.
MAX_COLS = 16384
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def reference_all_reduce_add_rms_norm(
    parts: Sequence[torch.Tensor], residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """NCCL's all-reduce (rounded to the dtype) then `fused_add_rms_norm`."""
    total = sum(p.float() for p in parts).to(parts[0].dtype)
    return fused_add_rms_norm(total, residual, weight, eps)


def _open_peer(args: tuple, device: torch.device) -> torch.Tensor:
    """A peer's tensor from its `reduce_tensor` arguments, mapped in *this* rank's device context
    (as vLLM's custom all-reduce opens its handles): torch would open it under the owner's device,
    which enables no peer access from ours (an illegal address in the kernel) and creates a
    context on the owner's GPU. The tensor claims this device; only its address is used."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(args)
    args[6] = device.index  # storage_device
    args[14] = False  # event_sync_required: shared after a synchronize, nothing to wait for
    return rebuild_cuda_tensor(*args)


class PeerAllReduce:
    """One-shot all-reduce among the `world` ranks of one host whose GPUs can access each other.

    `buffers[r]` / `flags[r]` are rank r's staging buffer and flags as this rank sees them
    (its own at `rank`). Build it with `PeerAllReduce.create`.
    """

    def __init__(
        self,
        rank: int,
        world: int,
        buffers: Sequence[torch.Tensor],
        flags: Sequence[torch.Tensor],
        max_bytes: int,
    ) -> None:
        self.rank, self.world = rank, world
        self.max_bytes = max_bytes
        self.buffers, self.flags = list(buffers), list(flags)  # keep the mappings alive
        device = buffers[rank].device
        self.half = buffers[rank].numel() // 2  # elements of one half, in the buffer's dtype
        self.buffer_ptrs = torch.tensor([b.data_ptr() for b in buffers], device=device)
        self.flag_ptrs = torch.tensor([f.data_ptr() for f in flags], device=device)
        self.counters = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
        # Programs a call runs: all must be resident at once (a spinning program must never keep
        # a peer's from starting), so at most one per SM.
        self.max_programs = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4  # the interpreter (tests): few, to loop over rows
        )

    @classmethod
    def create(
        cls,
        rank: int,
        world: int,
        device: torch.device,
        max_bytes: int,
        all_gather: Callable[[bytes], list[bytes]],
    ) -> PeerAllReduce:
        """Allocate this rank's buffer and flags, share them through `all_gather` (every rank's
        bytes, in rank order; the host's store) and map the peers'. Every rank calls it."""
        from torch.multiprocessing.reductions import reduce_tensor

        # Two halves of `max_bytes`, as fp32 elements (a view per dtype at launch).
        buffer = torch.zeros(2 * max_bytes // 4, dtype=torch.float32, device=device)
        flags = torch.zeros(MAX_PROGRAMS * world, dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        mine = pickle.dumps([reduce_tensor(buffer)[1], reduce_tensor(flags)[1]])
        buffers, flag_arrays = [], []
        for r, blob in enumerate(all_gather(mine)):
            if r == rank:
                buffers.append(buffer)
                flag_arrays.append(flags)
                continue
            b_args, f_args = pickle.loads(blob)
            buffers.append(_open_peer(b_args, device))
            flag_arrays.append(_open_peer(f_args, device))
        return cls(rank, world, buffers, flag_arrays, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this one-shot path takes `x` (else the host's NCCL does)."""
        if x.dtype not in DTYPES or not x.is_cuda or x.nbytes > self.max_bytes:
            return False
        cols = x.shape[-1] if x.dim() else 1
        return x.is_contiguous() and cols <= MAX_COLS and x.numel() // max(cols, 1) <= MAX_ROWS

    def _launch(self, x, out, residual, residual_out, weight, eps) -> None:
        from atom_kernels.backends.triton import peer_all_reduce

        rows = x.reshape(-1, x.shape[-1])
        half = self.half * 4 // x.element_size()
        peer_all_reduce.launch(
            rows,
            out.view(rows.shape),
            residual,
            residual_out,
            weight,
            eps,
            self.buffer_ptrs,
            self.flag_ptrs,
            self.counters,
            half,
            self.rank,
            self.world,
            min(self.max_programs, MAX_PROGRAMS),
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, a new tensor (the caller checked `fits`)."""
        out = torch.empty_like(x)
        self._launch(x, out, None, None, None, 0.0)
        return out

    def all_reduce_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum(x) + residual), sum(x) + residual), as NCCL then `fused_add_rms_norm`."""
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        rows = residual.reshape(-1, residual.shape[-1])
        self._launch(x, out, rows, new_residual, weight, eps)
        return out, new_residual
