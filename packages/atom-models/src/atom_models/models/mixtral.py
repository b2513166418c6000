"""Mixtral: Llama attention (sliding window on every layer when set); softmax top-k routed experts
with renormalized weights. Published checkpoints name the block `block_sparse_moe` and the
experts' projections `w1` (gate), `w3` (up), `w2` (down); transformers 5 names the block `mlp`,
as this model does."""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_models.layers.linear import ReplicatedLinear
from atom_models.layers.moe import FusedMoE, fused_moe_mapping
from atom_models.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel


class MixtralSparseMoeBlock(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.gate = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=False)
        self.experts = FusedMoE(
            config.num_local_experts, config.hidden_size, config.intermediate_size
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.gate(hidden_states)  # [T, E]
        topk_weights, topk_ids = atom_kernels.topk_softmax(
            router_logits, self.top_k, renormalize=True
        )
        return self.experts(hidden_states, topk_weights, topk_ids)


class MixtralDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        return MixtralSparseMoeBlock(config)


class MixtralModel(LlamaModel):
    decoder_layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaForCausalLM):
    model_cls = MixtralModel

    def __init__(self, config) -> None:
        super().__init__(config)
        self.packed_modules_mapping = {
            **fused_moe_mapping(
                config.num_local_experts,
                gate="w1",
                up="w3",
                down="w2",
                checkpoint_prefix="block_sparse_moe.experts",
                param_prefix="mlp.experts",
            ),
            "block_sparse_moe.gate": ("mlp.gate", None),
            **LlamaForCausalLM.packed_modules_mapping,
        }
