"""Mixture-of-experts: every expert of a layer in one module, computed by `atom_kernels.fused_moe`.

`FusedMoE` owns all expert weights of its rank as two stacked tensors (E = this rank's experts,
H = hidden size, I = expert intermediate size / tp_size):

    w13_weight [E, 2I, H]  gate (w1) rows then up (w3) rows     w13_bias [E, 2I]  (optional)
    w2_weight  [E, H, I]   down projection                      w2_bias  [E, H]   (optional)

Like vLLM, tensor parallelism splits the intermediate dim (each rank computes a partial sum of
every expert's output, then one all-reduce) and expert parallelism gives each rank a contiguous
range of whole experts (`ep_rank` / `ep_size`, or the host group's `enable_expert_parallel`: the
tensor-parallel ranks become the expert-parallel ones; only the weights it owns are loaded).

Checkpoints come in two layouts, both accepted:
- per expert (as published): `experts.{e}.gate_proj.weight` [I, H] (Mixtral: `w1`, `w3`, `w2`)
  -> shard ids (e, "w1" | "w3" | "w2"), routed by the model's mapping (`fused_moe_mapping`);
- stacked 3-D (transformers 5's own layout, GPT-OSS as published): `experts.gate_up_proj`
  [E, 2I, H] and `experts.down_proj` [E, H, I]; GPT-OSS stores them transposed ([E, H, 2I],
  [E, I, H]) with gate and up interleaved along 2I (`checkpoint_transposed`,
  `checkpoint_interleaved`). They are repacked at load into the layout above.
"""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_kernels.ops.moe import ACTIVATIONS
from atom_models.distributed import divide, get_tp_group
from atom_models.layers.int_checkpoint import to_canonical

ShardId = tuple[int, str]  # (global expert id, "w1" | "w3" | "w2")

# A per-expert checkpoint module's tensors: the weight and the scales of FP8 checkpoints, the
# tensors of integer ones (compressed-tensors pack-quantized, GPTQ, AWQ: `int_checkpoint`).
CHECKPOINT_SUFFIXES = (
    "weight", "weight_scale_inv", "weight_scale", "input_scale",
    "weight_packed", "weight_zero_point", "weight_shape", "weight_g_idx",
    "qweight", "qzeros", "scales", "g_idx",
)  # fmt: skip


class UnquantizedMoEMethod:
    """Experts in the activation dtype."""

    def create_weights(self, layer: FusedMoE) -> None:
        pass

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        pass

    def kernel_args(self, layer: FusedMoE) -> dict:
        return {}


UNQUANTIZED_MOE = UnquantizedMoEMethod()


def fused_moe_mapping(
    num_experts: int,
    *,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    checkpoint_prefix: str = "experts",
    param_prefix: str = "experts",
) -> dict[str, tuple[str, ShardId | None]]:
    """`packed_modules_mapping` entries routing a checkpoint's expert tensors into a FusedMoE:
    per-expert tensors `{checkpoint_prefix}.{e}.{gate|up|down}.weight` and stacked 3-D ones
    (`experts.gate_up_proj`, ... under any parent module).

    Put them before the dense `gate_proj` / `up_proj` entries: the first matching key wins.
    """
    mapping: dict[str, tuple[str, ShardId | None]] = {
        f"experts.{name}": (f"experts.{param}", None)
        for name, param in (
            ("gate_up_proj", "w13_weight"),
            ("gate_up_proj_bias", "w13_bias"),
            ("down_proj", "w2_weight"),
            ("down_proj_bias", "w2_bias"),
            # MXFP4 (GPT-OSS): e2m1 blocks and their e8m0 scales
            ("gate_up_proj_blocks", "w13_weight"),
            ("gate_up_proj_scales", "w13_weight_scale"),
            ("down_proj_blocks", "w2_weight"),
            ("down_proj_scales", "w2_weight_scale"),
        )
    }
    for expert in range(num_experts):
        for name, param, shard in ((gate, "w13", "w1"), (up, "w13", "w3"), (down, "w2", "w2")):
            # the weight, and the scales of a quantized checkpoint
            for suffix in CHECKPOINT_SUFFIXES:
                key = f"{checkpoint_prefix}.{expert}.{name}.{suffix}"
                mapping[key] = (f"{param_prefix}.{param}_{suffix}", (expert, shard))
    return mapping


class FusedMoE(nn.Module):
    """experts(x [T, H], topk_weights [T, K], topk_ids [T, K] global expert ids) -> [T, H]."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        activation: str = "silu",
        bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        checkpoint_transposed: bool = False,
        checkpoint_interleaved: bool = False,
        reduce_results: bool = True,
        ep_rank: int = 0,
        ep_size: int = 1,
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"FusedMoE: activation {activation!r} is not one of {ACTIVATIONS}")
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        if getattr(self.tp, "enable_expert_parallel", False) and self.tp.size > 1:
            # Expert parallelism over the host's tensor-parallel ranks: each holds whole experts
            # (the intermediate dim is not split) and the same all-reduce sums their outputs.
            ep_rank, ep_size = self.tp.rank, self.tp.size
            self.tp_rank, self.tp_size = 0, 1
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.total_num_experts = num_experts
        self.num_experts = divide(num_experts, ep_size, "number of experts")  # this rank's
        self.expert_start = ep_rank * self.num_experts
        if ep_size > 1:
            # Global expert id -> this rank's index of it, or -1 (another rank's): one gather a
            # call instead of five elementwise kernels. Computed, not loaded: built on the CPU
            # (the model may be built on `meta`) and moved with the model.
            with torch.device("cpu"):
                local = torch.arange(num_experts, dtype=torch.int32) - self.expert_start
                local[(local < 0) | (local >= self.num_experts)] = -1
            self.register_buffer("ep_local_ids", local, persistent=False)
        self.hidden_size = hidden_size
        self.total_intermediate_size = intermediate_size
        self.intermediate_size = divide(intermediate_size, self.tp_size, "expert intermediate size")
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.checkpoint_transposed = checkpoint_transposed
        self.checkpoint_interleaved = checkpoint_interleaved
        self.reduce_results = reduce_results
        self.quant_method = UNQUANTIZED_MOE

        experts = range(self.expert_start, self.expert_start + self.num_experts)
        w13_shards = [(e, s) for e in experts for s in ("w1", "w3")]
        w2_shards = [(e, "w2") for e in experts]
        size = self.intermediate_size
        self.w13_weight = self._param((self.num_experts, 2 * size, hidden_size), w13_shards)
        self.w2_weight = self._param((self.num_experts, hidden_size, size), w2_shards)
        self.w13_weight.weight_loader = self.w13_loader
        self.w2_weight.weight_loader = self.w2_loader
        if bias:
            self.w13_bias = self._param((self.num_experts, 2 * size), w13_shards)
            self.w2_bias = self._param((self.num_experts, hidden_size), w2_shards)
            self.w13_bias.weight_loader = self.w13_loader
            self.w2_bias.weight_loader = self.w2_loader
        else:
            self.register_parameter("w13_bias", None)
            self.register_parameter("w2_bias", None)

    @staticmethod
    def _param(shape: tuple[int, ...], shard_ids: list[ShardId]) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape), requires_grad=False)
        param.shard_ids = shard_ids
        return param

    # -- loading -------------------------------------------------------------------------------
    #
    # A parameter's rows and columns may be units of several weight rows and columns: a block
    # scale (`param.block` = [bn, bk]) or a packed weight (`param.packing` values per column).
    # `quant_kind` "tensor_scale" holds one value per checkpoint tensor ([E, 2] for w13: gate,
    # up; [E, 1] for w2).

    def _local(self, expert: int) -> int | None:
        local = expert - self.expert_start
        return local if 0 <= local < self.num_experts else None

    @staticmethod
    def _units(param: nn.Parameter) -> tuple[int, int]:
        if getattr(param, "quant_kind", "weight") == "block_scale":
            return param.block
        return 1, getattr(param, "packing", 1)

    def _tp_slice(self, t: torch.Tensor, dim: int, div: int = 1, what: str = "") -> torch.Tensor:
        """This rank's part of the intermediate dim `dim` of `t`, in units of `div` values."""
        size = self.intermediate_size
        if div > 1 and (size % div and self.tp_size > 1):
            raise ValueError(
                f"{what}: the expert intermediate size per rank ({size}) is not a multiple of "
                f"the quantization unit {div}; use a tensor-parallel size that splits it on units"
            )
        return t.narrow(dim, self.tp_rank * size // div, -(-size // div))

    def _stacked(self, param: nn.Parameter, loaded: torch.Tensor, full: tuple[int, ...]):
        """A 3-D weight (or 2-D bias) of every expert, `full` = [E, out, in] -> this rank's
        experts, [E_local, out, in]."""
        if loaded.dim() == 4 and param.dim() == 3:  # MXFP4 blocks [E, out, in / 32, 16]
            loaded = loaded.flatten(2)
        transposed = param.dim() == 3 and getattr(
            param, "checkpoint_transposed", self.checkpoint_transposed
        )
        expected = (full[0], full[2], full[1]) if transposed else full
        if tuple(loaded.shape) != expected:
            layout = " ([E, in, out], transposed)" if transposed else ""
            raise ValueError(
                f"stacked experts: checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                f"{expected}{layout}"
            )
        if transposed:
            loaded = loaded.transpose(1, 2)
        return loaded.narrow(0, self.expert_start, self.num_experts)

    def _full(self, param: nn.Parameter, rows: int, cols: int) -> tuple[int, ...]:
        """The checkpoint shape of one expert's tensor of `rows` x `cols` weight values."""
        row_div, col_div = self._units(param)
        return (-(-rows // row_div), -(-cols // col_div))[: param.dim() - 1]

    def _tensor_scale(self, param, loaded, shard_id, index: int) -> set[ShardId]:
        if shard_id is None or loaded.numel() != 1:
            raise ValueError(
                f"per-tensor expert scale: expected one value per expert tensor, got shape "
                f"{tuple(loaded.shape)}"
            )
        local = self._local(shard_id[0])
        if local is not None:
            param.data[local, index] = loaded.reshape(())
        return {shard_id} if local is not None else set()

    def _int_tensor(self, param: nn.Parameter, loaded: torch.Tensor, shard_id, rows, cols):
        """An integer checkpoint's tensor (`int_checkpoint`) in the canonical orientation, or
        the shards it fills when it is only checked (`weight_shape`, contiguous `g_idx`)."""
        role = param.int_role
        done = {shard_id} if shard_id is None or self._local(shard_id[0]) is not None else set()
        if role == "shape":
            shape = tuple(int(v) for v in loaded.reshape(-1).tolist())
            if shape != (rows, cols):
                raise ValueError(f"expert weight_shape {shape}, expected {(rows, cols)}")
            return None, done
        if role == "g_idx":
            groups = torch.arange(cols, device=loaded.device) // param.group_size
            if param.group_size == -1 or not torch.equal(loaded.reshape(-1).long(), groups):
                raise ValueError(
                    "expert g_idx is not contiguous groups (act-order experts are not "
                    "supported: fused_moe takes contiguous groups)"
                )
            return None, done
        return to_canonical(param.int_format, role, loaded, param.bits), None

    def w13_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None
    ) -> set[ShardId]:
        if hasattr(param, "int_role"):
            inter, hidden = self.total_intermediate_size, self.hidden_size
            loaded, done = self._int_tensor(param, loaded, shard_id, inter, hidden)
            if done is not None:
                return done
        row_div, _ = self._units(param)
        if getattr(param, "quant_kind", "weight") == "tensor_scale":
            return self._tensor_scale(param, loaded, shard_id, 0 if shard_id[1] == "w1" else 1)
        if shard_id is None:  # every expert's gate and up at once
            full = (
                self.total_num_experts,
                *self._full(param, 2 * self.total_intermediate_size, self.hidden_size),
            )
            loaded = self._stacked(param, loaded, full)
            if self.checkpoint_interleaved:
                if row_div != 1:
                    raise ValueError("interleaved gate/up rows cannot carry block scales")
                gate, up = loaded[:, 0::2], loaded[:, 1::2]
            else:
                if self.total_intermediate_size % row_div:
                    raise ValueError(
                        f"stacked experts: intermediate size {self.total_intermediate_size} is "
                        f"not a multiple of the weight block {row_div}"
                    )
                gate, up = loaded.chunk(2, dim=1)
            what = "experts' gate/up"
            param.data.copy_(
                torch.cat(
                    (self._tp_slice(gate, 1, row_div, what), self._tp_slice(up, 1, row_div, what)),
                    dim=1,
                )
            )
            return set(param.shard_ids)
        expert, which = shard_id
        if which not in ("w1", "w3"):
            raise ValueError(f"w13 shard id must be (expert, 'w1' | 'w3'), got {shard_id!r}")
        expected = self._full(param, self.total_intermediate_size, self.hidden_size)
        if getattr(param, "quant_kind", "weight") == "channel_scale" and loaded.dim() == 2:
            loaded = loaded.reshape(-1)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {expert} {which}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected {expected}"
            )
        local = self._local(expert)
        if local is None:
            return set()  # another expert-parallel rank's expert
        if row_div > 1 and self.total_intermediate_size % row_div:
            raise ValueError(
                f"expert {expert} {which}: intermediate size {self.total_intermediate_size} is "
                f"not a multiple of the weight block {row_div}, so gate and up cannot share "
                "one block grid"
            )
        rows = -(-self.intermediate_size // row_div)
        offset = 0 if which == "w1" else rows
        piece = self._tp_slice(loaded, 0, row_div, f"expert {expert} {which}")
        param.data[local].narrow(0, offset, rows).copy_(piece)
        return {shard_id}

    def w2_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None
    ) -> set[ShardId]:
        if hasattr(param, "int_role"):
            hidden, inter = self.hidden_size, self.total_intermediate_size
            loaded, done = self._int_tensor(param, loaded, shard_id, hidden, inter)
            if done is not None:
                return done
        kind = getattr(param, "quant_kind", "weight")
        if kind == "tensor_scale":
            return self._tensor_scale(param, loaded, shard_id, 0)
        _, col_div = self._units(param)
        # A bias [E, H] or per-row scale [E, H] is not split (the bias is added by rank 0 only).
        rows_only = param.dim() == 2
        if shard_id is None:
            full = (
                self.total_num_experts,
                *self._full(param, self.hidden_size, self.total_intermediate_size),
            )
            loaded = self._stacked(param, loaded, full)
            param.data.copy_(
                loaded if rows_only else self._tp_slice(loaded, 2, col_div, "experts' down")
            )
            return set(param.shard_ids)
        expert, which = shard_id
        if which != "w2":
            raise ValueError(f"w2 shard id must be (expert, 'w2'), got {shard_id!r}")
        expected = self._full(param, self.hidden_size, self.total_intermediate_size)
        if kind == "channel_scale" and loaded.dim() == 2:
            loaded = loaded.reshape(-1)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {expert} w2: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected {expected}"
            )
        local = self._local(expert)
        if local is None:
            return set()
        piece = loaded if rows_only else self._tp_slice(loaded, 1, col_div, f"expert {expert} w2")
        param.data[local].copy_(piece)
        return {shard_id}

    # -- compute -------------------------------------------------------------------------------

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.ep_size > 1:
            # Experts of other ranks are -1 here: fused_moe skips them (no GEMM work, no weight
            # read) and the all-reduce below sums the EP group's parts.
            table = self.ep_local_ids
            if table.device != topk_ids.device:  # a host that placed the model itself: once
                self.ep_local_ids = table = table.to(topk_ids.device)
            topk_ids = table[topk_ids]
        expert_weights = getattr(self.quant_method, "expert_weights", None)
        w13, w2 = expert_weights(self) if expert_weights else (self.w13_weight, self.w2_weight)
        out = atom_kernels.fused_moe(
            hidden_states,
            w13,
            w2,
            topk_weights,
            topk_ids,
            activation=self.activation,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias if self.tp_rank == 0 else None,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
            **self.quant_method.kernel_args(self),
        )
        # NOTE: with expert parallelism an all-to-all dispatch of the tokens to their experts'
        # ranks would replace this all-reduce (a later optimisation; this is its seam).
        if self.reduce_results and self.tp.size > 1:
            out = self.tp.all_reduce(out)
        return out
