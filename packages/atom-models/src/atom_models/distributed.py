"""The tensor-parallel group a host hands to the model layers.

The host (ATOM's engine, vLLM, SGLang) owns its communicator; layers only need rank, size,
all-reduce and all-gather. `TPGroup` wraps a `torch.distributed` process group; a host with its own
communicator (vLLM's custom all-reduce, say) passes any object with the same four members. A group
with `enable_expert_parallel = True` gives MoE layers built over it expert parallelism: each rank
holds whole experts instead of a slice of every expert (`FusedMoE`). A group with
`pad_attention_heads = True` lets attention layers whose heads do not split over its ranks pad them
with zero heads (`padded_attention_heads`); only a host that sizes its KV cache from the layers'
own `AttentionSpec` (ATOM's engine) may set it.
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

    def __init__(
        self, group: dist.ProcessGroup | None = None, pad_attention_heads: bool = False
    ) -> None:
        self.group = group
        self.pad_attention_heads = pad_attention_heads
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


def padded_attention_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(query heads, KV heads) of a model's attention padded with zero "dummy" heads so that they
    split over `tp_size` ranks (vLLM's `num_dummy_heads`); unchanged when they already split.

    The GQA grouping is kept: every KV head serves g = num_heads / num_kv_heads query heads, and
    the dummy query heads attach to the dummy KV heads, all appended after the real ones. The KV
    heads become the smallest count >= num_kv_heads that either splits evenly (a multiple of
    tp_size) or is replicated evenly (a divisor of tp_size whose tp_size / count ranks per KV head
    split its g query heads). 9 / 3 heads over 2 ranks -> 12 / 4; 3 / 3 (MHA) over 2 -> 4 / 4;
    9 / 3 over 8 -> 24 / 8 (4 KV heads on 2 ranks each would split a group of 3).
    """
    if num_heads % num_kv_heads:
        raise ValueError(
            f"the model's {num_heads} attention heads are not a multiple of its "
            f"{num_kv_heads} KV heads"
        )
    group, kv = num_heads // num_kv_heads, num_kv_heads
    while kv % tp_size and (tp_size % kv or group % (tp_size // kv)):
        kv += 1
    return kv * group, kv
