"""DeepSeek-V2 / V2-Lite (`DeepseekV2ForCausalLM`): DeepSeek-V3's multi-head latent attention
(interleaved rope) with softmax-scored experts: plain top-k (`topk_method="greedy"`) or
group-limited (`"group_limited_greedy"`: the best `topk_group` groups by their best score), the
weights unnormalized and scaled by `routed_scaling_factor`; shared experts; dense layers first."""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_models.layers.linear import ReplicatedLinear
from atom_models.layers.moe import FusedMoE
from atom_models.models.deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
)
from atom_models.models.llama import LlamaMLP, LlamaModel

TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekV2Gate(ReplicatedLinear):
    """Router logits in fp32, as transformers computes them, from a weight held in fp32 (the
    checkpoint's values rounded to the model dtype; as Glm4MoeGate's)."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__(hidden_size, num_experts, bias=bias)
        self.weight.fixed_dtype = torch.float32
        self.weight.values_dtype = None  # the model's dtype, set by loader.materialize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.float(), self.weight.float())


class DeepseekV2MoE(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        method = getattr(config, "topk_method", "greedy")
        if method not in TOPK_METHODS:
            raise ValueError(f"DeepSeek-V2: topk_method {method!r} is not one of {TOPK_METHODS}")
        self.top_k = config.num_experts_per_tok
        if method == "greedy":  # every expert competes: one group, kept
            self.num_expert_group = self.topk_group = 1
        else:
            self.num_expert_group, self.topk_group = config.n_group, config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = DeepseekV2Gate(config.hidden_size, config.n_routed_experts, bias=False)
        self.experts = FusedMoE(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )
        self.shared_experts = LlamaMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # transformers' DeepSeek-V2 router never renormalizes the top-k softmax scores.
        topk_weights, topk_ids = atom_kernels.grouped_topk(
            self.gate(hidden_states),  # [T, E] fp32
            self.top_k,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            scoring_func="softmax",
            renormalize=False,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        out = self.experts(hidden_states, topk_weights, topk_ids)
        return out + self.shared_experts(hidden_states)


class DeepseekV2DecoderLayer(DeepseekV3DecoderLayer):
    attention_cls = DeepseekV3Attention  # config has no rope_interleave: interleaved, as V2's

    def build_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        if layer_idx >= config.first_k_dense_replace:
            return DeepseekV2MoE(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class DeepseekV2Model(LlamaModel):
    decoder_layer_cls = DeepseekV2DecoderLayer


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    model_cls = DeepseekV2Model
