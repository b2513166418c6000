"""DeepSeek-V3 / R1 and Kimi-K2 (`DeepseekV3ForCausalLM`): multi-head latent attention over a
latent cache; sigmoid-scored experts with a score-correction bias, group-limited top-k, scaled
routed weights and shared experts; dense layers first (`first_k_dense_replace`); the
multi-token-prediction layers as speculative-decoding drafters (`atom_models.models.mtp`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from atom_models.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_models.layers.mla import MLAAttention
from atom_models.layers.moe import fused_moe_mapping
from atom_models.layers.norm import RMSNorm
from atom_models.layers.prefetch import WeightPrefetch
from atom_models.layers.rotary import get_rope, rope_parameters
from atom_models.models.glm4_moe import Glm4MoeMoE
from atom_models.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from atom_models.models.mtp import MTPLayerMixin, MultiTokenPredictionMixin

# transformers' DeepseekV3Attention builds q_a_layernorm and kv_a_layernorm with RMSNorm's
# default eps, not config.rms_norm_eps.
LORA_NORM_EPS = 1e-6


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(config, qk_head_dim: int) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under DeepSeek YaRN (the
    rotary cache itself carries the mscale / mscale_all_dim ratio)."""
    scale = qk_head_dim**-0.5
    _, scaling = rope_parameters(config)
    if scaling and scaling.get("mscale_all_dim"):
        mscale = yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"]))
        scale = scale * mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    """MLA: q through a low-rank path (q_a_proj, q_a_layernorm, q_b_proj) or q_proj; the latent
    and the shared rope key from kv_a_proj_with_mqa; kv_b_proj up-projects inside attention."""

    def __init__(self, config, layer_idx: int, prefix: str) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_num_heads = config.num_attention_heads
        self.qk_nope_head_dim = dn = config.qk_nope_head_dim
        self.qk_rope_head_dim = r = config.qk_rope_head_dim
        self.v_head_dim = dv = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        bias = getattr(config, "attention_bias", False)
        qk_head_dim = dn + r
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, total_num_heads * qk_head_dim)
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, total_num_heads * qk_head_dim)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.kv_lora_rank + r, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, total_num_heads * (dn + dv))
        self.o_proj = RowParallelLinear(total_num_heads * dv, hidden, bias=bias)
        self.num_heads = self.kv_b_proj.weight.shape[0] // (dn + dv)  # this rank's
        base, scaling = rope_parameters(config)
        self.rotary_emb = get_rope(
            r,
            config.max_position_embeddings,
            base,
            scaling,
            # DeepSeek rotates interleaved pairs; the layout of the rotated dims differs from
            # transformers' (which de-interleaves), but q_pe and k_pe share it: same dot products.
            is_neox=not getattr(config, "rope_interleave", True),
        )
        self.attn = MLAAttention(
            self.num_heads,
            dn,
            r,
            dv,
            self.kv_lora_rank,
            mla_softmax_scale(config, qk_head_dim),
            self.kv_b_proj,
            prefix=f"{prefix}.attn",
        )
        # While MLA runs: o_proj's weights (and the MLP's first, added by the decoder layer)
        # asked of L2 (layers/prefetch.py, ATOM_L2_PREFETCH's attn stage).
        self.prefetch = WeightPrefetch("attn", [self.o_proj])

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # T = tokens, H = heads, Dn / R = nope / rope head dims, L = kv_lora_rank
        num_tokens = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(num_tokens, self.num_heads, -1)  # [T, H, Dn + R]
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(hidden_states)  # [T, L + R]
        kv_c, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        # Strided views straight into the norm and the rotary kernels (both take row strides):
        # no copy kernels a layer.
        kv_c = self.kv_a_layernorm(kv_c)  # [T, L]
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        q_pe = q_pe.view(num_tokens, self.num_heads, -1)  # [T, H, R]
        self.prefetch.start(kv_c)
        out = self.attn(q_nope, q_pe, kv_c, k_pe)  # [T, H * Dv]
        return self.o_proj(out)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_cls = DeepseekV3Attention

    def build_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        if layer_idx >= config.first_k_dense_replace:
            return Glm4MoeMoE(config)  # the same routing, experts and shared experts
        return LlamaMLP(config.hidden_size, config.intermediate_size)


class DeepseekV3Model(LlamaModel):
    decoder_layer_cls = DeepseekV3DecoderLayer


class DeepseekV3MTPLayer(MTPLayerMixin, DeepseekV3DecoderLayer):
    pass


class DeepseekV3ForCausalLM(MultiTokenPredictionMixin, LlamaForCausalLM):
    model_cls = DeepseekV3Model
    mtp_layer_cls = DeepseekV3MTPLayer

    def __init__(self, config) -> None:
        super().__init__(config)
        self.packed_modules_mapping = {
            **fused_moe_mapping(config.n_routed_experts),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", 1),
        }
        self.add_mtp_layers()
