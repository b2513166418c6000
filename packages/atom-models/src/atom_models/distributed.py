"""The tensor-parallel group a host hands to the model layers.

The host (ATOM's engine, vLLM, SGLang) owns its communicator; layers only need rank, size,
all-reduce and all-gather. `TPGroup` wraps a `torch.distributed` process group; a host with its own
communicator (vLLM's custom all-reduce, say) passes any object with the same four members. A group
with `enable_expert_parallel = True` gives MoE layers built over it expert parallelism: each rank
holds whole experts instead of a slice of every expert (`FusedMoE`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import torch
import torch.distributed as dist


class TensorParallelGroup(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor: ...


class TPGroup:
    """A tensor-parallel group over torch.distributed (NCCL on GPU, gloo on CPU).

    `TPGroup()` with no process group is the single-rank group: collectives are identities.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        if group is None:
            self.rank, self.size = 0, 1
        else:
            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


_current: TensorParallelGroup = TPGroup()


def get_tp_group() -> TensorParallelGroup:
    """The group layers built now shard over (set by the host around model construction)."""
    return _current


@contextlib.contextmanager
def tp_group(group: TensorParallelGroup) -> Iterator[TensorParallelGroup]:
    """Build models inside this block to shard their layers over `group`."""
    global _current
    previous, _current = _current, group
    try:
        yield group
    finally:
        _current = previous


def divide(numerator: int, denominator: int, what: str = "size") -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} {numerator} is not divisible by the tensor-parallel size {denominator}"
        )
    return numerator // denominator
