"""Linear layers that shard over the host's tensor-parallel group.

Each layer creates its parameters at their per-rank size and attaches a `weight_loader` that cuts
this rank's slice out of the full checkpoint tensor. Packed layers (QKV, gate/up) take a `shard_id`
naming which checkpoint tensor is being loaded and record the ids they expect in
`param.shard_ids`, so the generic loader can tell when a packed parameter is complete.

How a layer computes is its `quant_method` (`atom_models.quantization`): unquantized by default;
a quantized checkpoint swaps in a method that replaces `weight` with its quantized form and adds
scale parameters. One loader serves them all: it knows which rows (output features) and columns
(input features) of each checkpoint tensor belong to this rank, and a parameter's `quant_kind`
says how its rows and columns relate to the weight's:

    "weight"         the weight itself (or a packed form of it: `param.packing` columns a value)
    "block_scale"    one value per [bn, bk] weight block (`param.block`)
    "channel_scale"  one value per output row
    "tensor_scale"   one value per checkpoint tensor (one per shard of a packed layer)
    "int"            a tensor of an integer checkpoint, repacked by `int_checkpoint`

Attention heads that do not split over the ranks may be padded with zero "dummy" heads
(`atom_models.distributed.padded_attention_heads`): then a rank's rows (QKV) or columns (o_proj)
of a checkpoint tensor are followed by `row_padding` / `col_padding` rows / columns that the
checkpoint lacks; the loader zeroes them (weights, biases and scales alike), so a dummy head
projects to zeros and its o_proj columns add nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_models.distributed import divide, get_tp_group, padded_attention_heads
from atom_models.layers.int_checkpoint import load_int_linear


def _check_shape(loaded: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(expected)}"
        )


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Copy a replicated (unsharded) tensor into `param`."""
    _check_shape(loaded, tuple(param.shape), "weight")
    param.data.copy_(loaded)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class UnquantizedLinearMethod:
    """The weight in the activation dtype: `atom_kernels.linear`."""

    def create_weights(self, layer: LinearBase) -> None:
        pass

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        pass

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        import atom_kernels

        return atom_kernels.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


class LinearBase(nn.Module):
    """y = x W^T (+ b), with W stored [output_size, input_size] at this rank's size."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.input_size, self.output_size = input_size, output_size  # this rank's
        self.quant_method = UNQUANTIZED
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    # -- geometry: which part of a checkpoint tensor this rank holds ---------------------------

    def row_plan(self, shard_id) -> tuple[int, int, int, int]:
        """(offset in this rank's rows, offset in the checkpoint tensor's rows, rows, rows of the
        whole checkpoint tensor) for the checkpoint tensor of `shard_id`."""
        return 0, 0, self.output_size, self.output_size

    def col_plan(self) -> tuple[int, int, int]:
        """(offset in the checkpoint tensor's columns, columns, columns of the whole tensor)."""
        return 0, self.input_size, self.input_size

    def row_padding(self, shard_id) -> int:
        """Zero rows (dummy heads) following this rank's rows of the tensor of `shard_id`."""
        return 0

    def col_padding(self) -> int:
        """Zero columns (dummy heads) following this rank's columns of the checkpoint tensor."""
        return 0

    # -- loading -------------------------------------------------------------------------------

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        kind = getattr(param, "quant_kind", "weight")
        values_dtype = getattr(param, "values_dtype", None)  # loader.materialize
        if values_dtype is not None and loaded.is_floating_point():
            loaded = loaded.to(values_dtype)
        if kind == "int":  # GPTQ, AWQ, compressed-tensors pack-quantized
            return load_int_linear(self, param, loaded, shard_id)
        what = "weight" if shard_id is None else f"shard {shard_id}"
        if kind == "tensor_scale":
            if loaded.numel() != 1:
                raise ValueError(
                    f"{what} scale: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                    "one value (a per-tensor scale)"
                )
            ids = getattr(param, "shard_ids", [None])
            param.data[ids.index(shard_id) if shard_id in ids else 0] = loaded.reshape(())
            return
        dst, src, rows, full_rows = self.row_plan(shard_id)
        pad_rows = self.row_padding(shard_id)
        row_div, col_div = getattr(param, "block", (1, 1)) if kind == "block_scale" else (1, 1)
        if kind == "weight" and param.dim() == 2:
            col_div = getattr(param, "packing", 1)
        rows_end = _cdiv(dst + rows + pad_rows, row_div)  # this shard's rows end, padding too
        dst, src, rows, full_rows = self._in_units(
            (dst, src, rows, full_rows), row_div, param.shape[0], f"{what} rows", pad_rows
        )
        param.data[dst + rows : rows_end].zero_()  # dummy heads (a partial unit is loaded)
        if param.dim() == 1 or kind == "channel_scale":  # bias or per-channel scale
            if kind == "channel_scale" and loaded.dim() == 2 and loaded.shape[1] == 1:
                loaded = loaded.reshape(-1)
            _check_shape(loaded, (full_rows,), what)
            param.data.narrow(0, dst, rows).copy_(loaded.narrow(0, src, rows))
            return
        col_src, cols, full_cols = self.col_plan()
        pad_cols = self.col_padding()
        cols_end = _cdiv(cols + pad_cols, col_div)
        _, col_src, cols, full_cols = self._in_units(
            (0, col_src, cols, full_cols), col_div, param.shape[1], f"{what} columns", pad_cols
        )
        _check_shape(loaded, (full_rows, full_cols), what)
        piece = loaded.narrow(0, src, rows).narrow(1, col_src, cols)
        mine = param.data.narrow(0, dst, rows)
        mine.narrow(1, 0, cols).copy_(piece)
        mine[:, cols:cols_end].zero_()

    @staticmethod
    def _in_units(
        plan: tuple[int, int, int, int], div: int, local: int, what: str, padding: int = 0
    ):
        """A (dst, src, count, full) plan in weight rows/columns -> in units of `div` of them
        (weight blocks, packed values). Only a tensor's last unit may be partial, and only where
        it ends this rank's part of the layer or zero `padding` rows/columns fill it up."""
        dst, src, count, full = plan
        if div == 1:
            return plan
        partial = count % div != 0
        filled = _cdiv(dst + count, div) == local or count % div + padding >= div
        if dst % div or src % div or (partial and (src + count != full or not filled)):
            raise ValueError(
                f"{what}: this rank's slice (rows/columns {src}..{src + count} of {full}, at "
                f"{dst}) does not fall on the quantization blocks of {div}; the tensor-parallel "
                "size must split the layer at block boundaries"
            )
        return dst // div, src // div, _cdiv(count, div), _cdiv(full, div)

    # -- compute -------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(LinearBase):
    pass


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank keeps its slice of the output."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        self.total_output_size = output_size
        super().__init__(input_size, divide(output_size, get_tp_group().size), bias)

    def row_plan(self, shard_id) -> tuple[int, int, int, int]:
        size = self.output_size
        return 0, self.tp_rank * size, size, self.total_output_size


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed into one weight (gate/up -> gate_up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias)
        self.weight.shard_ids = list(range(len(output_sizes)))
        if bias:
            self.bias.shard_ids = list(range(len(output_sizes)))

    def row_plan(self, shard_id) -> tuple[int, int, int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"merged shard id must be in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        size = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        return offset, self.tp_rank * size, size, self.output_sizes[shard_id]


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed into one weight, split by heads across ranks.

    With more ranks than KV heads, each KV head is replicated on tp_size / num KV heads ranks. Over
    a group with `pad_attention_heads`, heads that do not split are padded with zero heads
    (`padded_attention_heads`: `num_dummy_heads` query and `num_dummy_kv_heads` KV heads after
    the checkpoint's), which the model's o_proj must take as zero input columns.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
    ) -> None:
        tp = get_tp_group()
        tp_size = tp.size
        self.head_size = head_size
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        num_heads, num_kv_heads = total_num_heads, total_num_kv_heads
        if getattr(tp, "pad_attention_heads", False):
            num_heads, num_kv_heads = padded_attention_heads(num_heads, num_kv_heads, tp_size)
        self.num_dummy_heads = num_heads - total_num_heads
        self.num_dummy_kv_heads = num_kv_heads - total_num_kv_heads
        self.num_heads = divide(num_heads, tp_size, "number of attention heads")
        if tp_size >= num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(tp_size, num_kv_heads, "tp size")
        else:
            self.num_kv_heads = divide(num_kv_heads, tp_size, "number of KV heads")
            self.num_kv_head_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size
        super().__init__(hidden_size, output_size * tp_size, bias)
        self.weight.shard_ids = ["q", "k", "v"]
        if bias:
            self.bias.shard_ids = ["q", "k", "v"]

    def _shard(self, shard_id) -> tuple[int, int, int, int]:
        """(offset in this rank's rows, offset in the padded tensor, rows, checkpoint rows)."""
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            return 0, self.tp_rank * q_size, q_size, self.total_num_heads * self.head_size
        if shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            index = self.tp_rank // self.num_kv_head_replicas
            return offset, index * kv_size, kv_size, self.total_num_kv_heads * self.head_size
        raise ValueError(f"QKV shard id must be 'q', 'k' or 'v', got {shard_id!r}")

    def row_plan(self, shard_id) -> tuple[int, int, int, int]:
        dst, start, size, full = self._shard(shard_id)
        rows = max(0, min(size, full - start))  # the dummy heads come after the checkpoint's
        return dst, start if rows else 0, rows, full

    def row_padding(self, shard_id) -> int:
        return self._shard(shard_id)[2] - self.row_plan(shard_id)[2]

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        return qkv.split([q_size, kv_size, kv_size], dim=-1)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        input_padding: int = 0,
    ) -> None:
        """`input_padding`: zero input features after the checkpoint's `input_size` (the o_proj
        columns of dummy attention heads, `QKVParallelLinear.num_dummy_heads` x head size)."""
        self.total_input_size = input_size
        size = divide(input_size + input_padding, get_tp_group().size)
        super().__init__(size, output_size, bias)
        self.reduce_results = reduce_results

    def col_plan(self) -> tuple[int, int, int]:
        start, size = self.tp_rank * self.input_size, self.input_size
        cols = max(0, min(size, self.total_input_size - start))
        return start if cols else 0, cols, self.total_input_size

    def col_padding(self) -> int:
        return self.input_size - self.col_plan()[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction (rank 0 only, then summed).
        y = self.quant_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.tp_size > 1 and self.reduce_results:
            y = self.tp.all_reduce(y)
        return y
