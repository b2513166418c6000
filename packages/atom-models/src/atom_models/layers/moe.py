"""Mixture-of-experts: every expert of a layer in one module, computed by `atom_kernels.fused_moe`.

`FusedMoE` owns all expert weights of its rank as two stacked tensors (E = this rank's experts,
H = hidden size, I = expert intermediate size / tp_size):

    w13_weight [E, 2I, H]  gate (w1) rows then up (w3) rows     w13_bias [E, 2I]  (optional)
    w2_weight  [E, H, I]   down projection                      w2_bias  [E, H]   (optional)

Like vLLM, tensor parallelism splits the intermediate dim (each rank computes a partial sum of
every expert's output, then one all-reduce) and expert parallelism gives each rank a contiguous
range of whole experts (`ep_rank` / `ep_size`; only the weights it owns are loaded).

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

ShardId = tuple[int, str]  # (global expert id, "w1" | "w3" | "w2")


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
        )
    }
    for expert in range(num_experts):
        for name, param, shard in ((gate, "w13", "w1"), (up, "w13", "w3"), (down, "w2", "w2")):
            key = f"{checkpoint_prefix}.{expert}.{name}.weight"
            mapping[key] = (f"{param_prefix}.{param}_weight", (expert, shard))
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
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.total_num_experts = num_experts
        self.num_experts = divide(num_experts, ep_size, "number of experts")  # this rank's
        self.expert_start = ep_rank * self.num_experts
        self.hidden_size = hidden_size
        self.total_intermediate_size = intermediate_size
        self.intermediate_size = divide(intermediate_size, self.tp_size, "expert intermediate size")
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.checkpoint_transposed = checkpoint_transposed
        self.checkpoint_interleaved = checkpoint_interleaved
        self.reduce_results = reduce_results

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

    def _local(self, expert: int) -> int | None:
        local = expert - self.expert_start
        return local if 0 <= local < self.num_experts else None

    def _tp_slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.narrow(dim, self.tp_rank * self.intermediate_size, self.intermediate_size)

    def _stacked(self, param: nn.Parameter, loaded: torch.Tensor, full: tuple[int, ...]):
        """A 3-D weight (or 2-D bias) of every expert, `full` = [E, out, in] -> this rank's
        experts, [E_local, out, in]."""
        transposed = param.dim() == 3 and self.checkpoint_transposed
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

    def w13_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None
    ) -> set[ShardId]:
        full_rows = 2 * self.total_intermediate_size
        if shard_id is None:  # every expert's gate and up at once
            full = (self.total_num_experts, full_rows, self.hidden_size)[: param.dim()]
            loaded = self._stacked(param, loaded, full)
            if self.checkpoint_interleaved:
                gate, up = loaded[:, 0::2], loaded[:, 1::2]
            else:
                gate, up = loaded.chunk(2, dim=1)
            param.data.copy_(torch.cat((self._tp_slice(gate, 1), self._tp_slice(up, 1)), dim=1))
            return set(param.shard_ids)
        expert, which = shard_id
        if which not in ("w1", "w3"):
            raise ValueError(f"w13 shard id must be (expert, 'w1' | 'w3'), got {shard_id!r}")
        expected = (self.total_intermediate_size, self.hidden_size)[: param.dim() - 1]
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {expert} {which}: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected {expected}"
            )
        local = self._local(expert)
        if local is None:
            return set()  # another expert-parallel rank's expert
        offset = 0 if which == "w1" else self.intermediate_size
        param.data[local].narrow(0, offset, self.intermediate_size).copy_(self._tp_slice(loaded, 0))
        return {shard_id}

    def w2_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None
    ) -> set[ShardId]:
        is_bias = param.dim() == 2  # [E, H], not split: added once, by tp rank 0
        if shard_id is None:
            full = (self.total_num_experts, self.hidden_size, self.total_intermediate_size)
            loaded = self._stacked(param, loaded, full[: param.dim()])
            param.data.copy_(loaded if is_bias else self._tp_slice(loaded, 2))
            return set(param.shard_ids)
        expert, which = shard_id
        if which != "w2":
            raise ValueError(f"w2 shard id must be (expert, 'w2'), got {shard_id!r}")
        expected = (self.hidden_size, self.total_intermediate_size)[: param.dim() - 1]
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"expert {expert} w2: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected {expected}"
            )
        local = self._local(expert)
        if local is None:
            return set()
        param.data[local].copy_(loaded if is_bias else self._tp_slice(loaded, 1))
        return {shard_id}

    # -- compute -------------------------------------------------------------------------------

    def forward(
        self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        if self.ep_size > 1:
            # Experts of other ranks contribute nothing here; the host sums over the EP group.
            local_ids = topk_ids - self.expert_start
            owned = (local_ids >= 0) & (local_ids < self.num_experts)
            topk_ids = torch.where(owned, local_ids, 0)
            topk_weights = torch.where(owned, topk_weights, 0.0)
        out = atom_kernels.fused_moe(
            hidden_states,
            self.w13_weight,
            self.w2_weight,
            topk_weights,
            topk_ids,
            activation=self.activation,
            w13_bias=self.w13_bias,
            w2_bias=self.w2_bias if self.tp_rank == 0 else None,
            swiglu_alpha=self.swiglu_alpha,
            swiglu_limit=self.swiglu_limit,
        )
        if self.reduce_results and self.tp_size > 1:
            out = self.tp.all_reduce(out)
        return out
