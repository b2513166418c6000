"""GLM-4-MoE (GLM-4.5 / 4.6): partial rotary, optional q/k norm, no o_proj bias; sigmoid-scored
experts with a score-correction bias and group-limited top-k, scaled routed weights, a shared
expert, and dense layers first (`first_k_dense_replace`); the multi-token-prediction layers as
speculative-decoding drafters (`atom_models.models.mtp`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import atom_kernels
from atom_models.layers.attention import Attention
from atom_models.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_models.layers.moe import FusedMoE, fused_moe_mapping
from atom_models.layers.norm import RMSNorm
from atom_models.layers.prefetch import WeightPrefetch
from atom_models.layers.rotary import get_rope, partial_rotary_factor, rope_parameters
from atom_models.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    head_dim_of,
)
from atom_models.models.mtp import MTPLayerMixin, MultiTokenPredictionMixin


class Glm4MoeAttention(nn.Module):
    def __init__(self, config, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.head_dim = head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=False,
            input_padding=self.qkv_proj.num_dummy_heads * head_dim,
        )
        if getattr(config, "use_qk_norm", False):
            self.q_norm = RMSNorm(head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        base, scaling = rope_parameters(config)
        self.rotary_emb = get_rope(
            head_dim,
            config.max_position_embeddings,
            base,
            scaling,
            partial_rotary_factor=partial_rotary_factor(config),
        )
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            prefix=f"{prefix}.attn",
        )
        self.prefetch = WeightPrefetch("attn", [self.o_proj])  # layers/prefetch.py

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # T = tokens, D = head dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        self.prefetch.start(q)
        # Optional per-head q/k RMSNorms, inside the rotary kernel (partial rotary included),
        # and on ATOM's engine the K/V cache write too (Attention.forward_rope).
        out = self.attn.forward_rope(positions, q, k, v, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(out)


class Glm4MoeGate(ReplicatedLinear):
    """Router logits in fp32 (as HF computes them), and the per-expert score-correction bias
    (kept in fp32 in every model dtype: it decides near-ties between experts). The weight is
    held in fp32 too (the checkpoint's values rounded to the model dtype, as HF holds them): HF
    casts it on every call, a copy kernel and twice the weight's bytes a MoE layer of a step."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        self.weight.fixed_dtype = torch.float32
        self.weight.values_dtype = None  # the model's dtype, set by loader.materialize
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
        self.e_score_correction_bias.fixed_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class Glm4MoeMoE(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_expert_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = Glm4MoeGate(config.hidden_size, config.n_routed_experts)
        self.experts = FusedMoE(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )
        if config.n_shared_experts:
            self.shared_experts = LlamaMLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
            )
        else:
            self.shared_experts = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = atom_kernels.grouped_topk(
            self.gate(hidden_states),  # [T, E] fp32
            self.top_k,
            num_expert_group=self.num_expert_group,
            topk_group=self.topk_group,
            scoring_func="sigmoid",
            e_score_correction_bias=self.gate.e_score_correction_bias,
            renormalize=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
        )
        out = self.experts(hidden_states, topk_weights, topk_ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class Glm4MoeDecoderLayer(LlamaDecoderLayer):
    attention_cls = Glm4MoeAttention

    def build_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        if layer_idx >= config.first_k_dense_replace:
            return Glm4MoeMoE(config)
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class Glm4MoeModel(LlamaModel):
    decoder_layer_cls = Glm4MoeDecoderLayer


class Glm4MoeMTPLayer(MTPLayerMixin, Glm4MoeDecoderLayer):
    pass


class Glm4MoeForCausalLM(MultiTokenPredictionMixin, LlamaForCausalLM):
    model_cls = Glm4MoeModel
    mtp_layer_cls = Glm4MoeMTPLayer

    def __init__(self, config) -> None:
        super().__init__(config)
        self.packed_modules_mapping = {
            **fused_moe_mapping(config.n_routed_experts),
            **LlamaForCausalLM.packed_modules_mapping,
        }
        self.add_mtp_layers()
