"""Linear layers that shard over the host's tensor-parallel group.

Each layer creates its parameters at their per-rank size and attaches a `weight_loader` that cuts
this rank's slice out of the full checkpoint tensor. Packed layers (QKV, gate/up) take a `shard_id`
naming which checkpoint tensor is being loaded and record the ids they expect in
`param.shard_ids`, so the generic loader can tell when a packed parameter is complete.
"""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_models.distributed import divide, get_tp_group


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}"
        )


def _full_shape(param: nn.Parameter, rows: int, cols: int | None = None) -> tuple[int, ...]:
    """The unsharded checkpoint shape of a weight ([rows, cols]) or bias ([rows])."""
    return (rows,) if param.dim() == 1 else (rows, cols if cols is not None else param.shape[1])


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a replicated (unsharded) tensor into `param`."""
    _check_shape(loaded, tuple(param.shape), "weight")
    param.data.copy_(loaded)


class LinearBase(nn.Module):
    """y = x W^T (+ b), with W stored [output_size, input_size] at this rank's size."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, *args) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return atom_kernels.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.total_output_size = output_size
        super().__init__(input_size, divide(output_size, get_tp_group().size), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _check_shape(loaded, _full_shape(param, self.total_output_size), "column-parallel")
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed into one weight (gate/up -> gate_up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        self.weight.shard_ids = list(range(len(output_sizes)))
        if bias:
            self.bias.shard_ids = list(range(len(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _check_shape(loaded, _full_shape(param, self.output_sizes[shard_id]), f"shard {shard_id}")
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed into one weight, split by heads across ranks.

    With more ranks than KV heads, each KV head is replicated on tp_size / total_num_kv_heads ranks.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp_size = get_tp_group().size
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size, "number of attention heads")
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, total_num_kv_heads, "tp size")
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size
        super().__init__(hidden_size, output_size * tp_size, bias)
        self.weight.shard_ids = ["q", "k", "v"]
        if bias:
            self.bias.shard_ids = ["q", "k", "v"]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        total_heads = self.num_heads * self.tp_size
        total_kv_heads = self.num_kv_heads * self.tp_size // self.num_kv_head_replicas
        rows = (total_heads if shard_id == "q" else total_kv_heads) * self.head_size
        _check_shape(loaded, _full_shape(param, rows), f"{shard_id} projection")
        if shard_id == "q":
            offset, size, index = 0, q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, index = kv_size, self.tp_rank // self.num_kv_head_replicas
        else:
            raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        piece = loaded.narrow(0, index * size, size)
        param.data.narrow(0, offset, size).copy_(piece)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        return qkv.split([q_size, kv_size, kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True
    ) -> None:
        super().__init__(divide(input_size, get_tp_group().size), output_size, bias)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias is not split
            default_weight_loader(param, loaded)
            return
        size = param.shape[1]
        _check_shape(loaded, (param.shape[0], size * self.tp_size), "row-parallel")
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction (rank 0 only, then summed).
        y = atom_kernels.linear(x, self.weight, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1 and self.reduce_results:
            y = self.tp.all_reduce(y)
        return y
