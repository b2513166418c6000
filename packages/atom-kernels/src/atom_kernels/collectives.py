"""All-reduce for the small messages of tensor-parallel decode, over peer-mapped buffers.

`PeerAllReduce` holds one staging buffer per rank, mapped into every other rank's process (CUDA
IPC through `torch.multiprocessing`'s tensor sharing, each handle opened in the reader's device
context so peer access is enabled from it), and launches the one-shot Triton kernel of
`backends/triton/peer_all_reduce.py`: each rank pushes its rows into every rank's buffer and sums
what lands in its own; one kernel, no NCCL, no flags, no multicast, capturable in CUDA graphs (its
state lives on the device). `all_reduce_add_rms_norm` fuses the residual add and the next RMSNorm
into it. Messages it does not take (`fits`) stay with the host's NCCL.

`reference_all_reduce_add_rms_norm` is the PyTorch reference the kernel is tested against.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence

import torch

from atom_kernels.backends.torch.norm import fused_add_rms_norm

# The most programs of one call (it runs at most one per SM).
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

    `buffers[r]` is rank r's staging buffer as this rank sees it (its own at `rank`): int32 words
    of `PHASES` x `world` slots of `max_bytes`, empty (the kernel's mark) between calls. Build it
    with `PeerAllReduce.create`.
    """

    def __init__(
        self, rank: int, world: int, buffers: Sequence[torch.Tensor], max_bytes: int
    ) -> None:
        self.rank, self.world = rank, world
        self.max_bytes = max_bytes
        self.buffers = list(buffers)  # keep the mappings alive
        device = buffers[rank].device
        self._views: dict[torch.dtype, tuple[torch.Tensor, ...]] = {}  # the buffers by dtype
        # The phase this rank's next call uses, and its programs done with the current one.
        self.counter = torch.zeros(2, dtype=torch.int32, device=device)
        # Programs a call runs: all must be resident at once (a polling program must never keep
        # one of its own rank's from starting), so at most one per SM.
        self.max_programs = (
            torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda"
            else 4  # the interpreter (tests): few, to loop over rows
        )

    @staticmethod
    def empty_buffer(world: int, max_bytes: int, device: torch.device) -> torch.Tensor:
        """A rank's staging buffer, every slot empty."""
        from atom_kernels.backends.triton.peer_all_reduce import EMPTY32, PHASES

        words = PHASES * world * max_bytes // 4
        return torch.full((words,), EMPTY32, dtype=torch.int32, device=device)

    @classmethod
    def create(
        cls,
        rank: int,
        world: int,
        device: torch.device,
        max_bytes: int,
        all_gather: Callable[[bytes], list[bytes]],
    ) -> PeerAllReduce:
        """Allocate this rank's buffer, share it through `all_gather` (every rank's bytes, in rank
        order; the host's store) and map the peers'. Every rank calls it."""
        from torch.multiprocessing.reductions import reduce_tensor

        max_bytes = -(-max_bytes // 16) * 16  # slots start 16-byte aligned
        buffer = cls.empty_buffer(world, max_bytes, device)
        torch.cuda.synchronize(device)
        mine = pickle.dumps(reduce_tensor(buffer)[1])
        buffers = []
        for r, blob in enumerate(all_gather(mine)):
            buffers.append(buffer if r == rank else _open_peer(pickle.loads(blob), device))
        return cls(rank, world, buffers, max_bytes)

    def fits(self, x: torch.Tensor) -> bool:
        """Whether this one-shot path takes `x` (else the host's NCCL does)."""
        if x.dtype not in DTYPES or not x.is_cuda or x.nbytes > self.max_bytes:
            return False
        cols = x.shape[-1] if x.dim() else 1
        return x.is_contiguous() and cols <= MAX_COLS and x.numel() // max(cols, 1) <= MAX_ROWS

    def _launch(self, x, out, residual, residual_out, weight, eps, two_shot) -> None:
        from atom_kernels.backends.triton import peer_all_reduce

        rows = x.reshape(-1, x.shape[-1])
        views = self._views.get(x.dtype)
        if views is None:
            views = self._views[x.dtype] = tuple(b.view(x.dtype) for b in self.buffers)
        peer_all_reduce.launch(
            rows,
            out.view(rows.shape),
            residual,
            residual_out,
            weight,
            eps,
            views,
            self.counter,
            self.max_bytes // x.element_size(),
            self.rank,
            self.world,
            min(self.max_programs, MAX_PROGRAMS),
            two_shot,
        )

    def all_reduce(self, x: torch.Tensor, two_shot: bool = False) -> torch.Tensor:
        """Sum of `x` over the ranks, a new tensor (the caller checked `fits`). `two_shot`: each
        rank sums a 1/W share of the rows and sends the sums to the others (half the bytes a
        rank sends at W = 4, one more hop), instead of every rank summing every row."""
        out = torch.empty_like(x)
        self._launch(x, out, None, None, None, 0.0, two_shot)
        return out

    def all_reduce_add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        two_shot: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(sum(x) + residual), sum(x) + residual), as NCCL then `fused_add_rms_norm`."""
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        rows = residual.reshape(-1, residual.shape[-1])
        self._launch(x, out, rows, new_residual, weight, eps, two_shot)
        return out, new_residual
