"""Qwen3-MoE: Qwen3 attention; softmax top-k routed experts, with dense layers mixed in
(`mlp_only_layers`, `decoder_sparse_step`)."""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_models.layers.linear import ReplicatedLinear
from atom_models.layers.moe import FusedMoE, fused_moe_mapping
from atom_models.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel
from atom_models.models.qwen3 import Qwen3DecoderLayer


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False)
        self.experts = FusedMoE(
            config.num_experts, config.hidden_size, config.moe_intermediate_size
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)  # [T, E]
        topk_weights, topk_ids = atom_kernels.topk_softmax(
            router_logits, self.top_k, self.norm_topk_prob
        )
        return self.experts(hidden_states, topk_weights, topk_ids)


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (
        layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def build_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen3MoeSparseMoeBlock(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class Qwen3MoeModel(LlamaModel):
    decoder_layer_cls = Qwen3MoeDecoderLayer


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3MoeModel

    def __init__(self, config) -> None:
        super().__init__(config)
        self.packed_modules_mapping = {
            **fused_moe_mapping(config.num_experts),
            **LlamaForCausalLM.packed_modules_mapping,
        }
