"""GPT-OSS: attention with biases, per-head sinks, a sliding window on alternating layers and YaRN
rotary; experts stored stacked ([E, in, out], gate/up interleaved, with biases) behind a router
with a bias, clamped SwiGLU (`swiglu_oai`)."""

from __future__ import annotations

import torch
from torch import nn

import atom_kernels
from atom_models.layers.attention import Attention
from atom_models.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from atom_models.layers.moe import FusedMoE, fused_moe_mapping
from atom_models.layers.prefetch import WeightPrefetch
from atom_models.layers.rotary import get_rope, rope_parameters
from atom_models.models.llama import (
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    head_dim_of,
    sliding_window_of,
)


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_idx: int, prefix: str) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
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
            bias=config.attention_bias,
            input_padding=self.qkv_proj.num_dummy_heads * head_dim,
        )
        # One sink logit per query head, split across ranks with the heads (0 for dummy heads).
        self.sinks = nn.Parameter(torch.empty(self.qkv_proj.num_heads), requires_grad=False)
        self.sinks.weight_loader = self.sinks_loader
        base, scaling = rope_parameters(config)
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings, base, scaling)
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=sliding_window_of(config, layer_idx),
            has_sinks=True,
        )
        self.prefetch = WeightPrefetch("attn", [self.o_proj])  # layers/prefetch.py

    def sinks_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        num_heads, start = param.shape[0], self.qkv_proj.tp_rank * param.shape[0]
        expected = (self.qkv_proj.total_num_heads,)
        if tuple(loaded.shape) != expected:
            raise ValueError(
                f"sinks: checkpoint tensor has shape {tuple(loaded.shape)}, expected {expected}"
            )
        real = max(0, min(num_heads, expected[0] - start))  # dummy heads come last
        param.data.zero_()
        param.data[:real] = loaded[start : start + real]

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        self.prefetch.start(q)
        # The rotary and the K/V cache write: one kernel on ATOM's engine (Attention.forward_rope).
        out = self.attn.forward_rope(positions, q, k, v, self.rotary_emb, sinks=self.sinks)
        return self.o_proj(out)


class GptOssMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = FusedMoE(
            config.num_local_experts,
            config.hidden_size,
            config.intermediate_size,
            activation="swiglu_oai",
            bias=True,
            # transformers 5.17's config has neither attribute (its modeling code fixes alpha
            # 1.702 and limit 7.0); later versions carry both, with those defaults.
            swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
            swiglu_limit=getattr(config, "swiglu_limit", 7.0),
            checkpoint_transposed=True,
            checkpoint_interleaved=True,
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        router_logits = self.router(hidden_states)  # [T, E]
        topk_weights, topk_ids = atom_kernels.topk_then_softmax(router_logits, self.top_k)
        return self.experts(hidden_states, topk_weights, topk_ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = GptOssAttention

    def build_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        return GptOssMLP(config)


class GptOssModel(LlamaModel):
    decoder_layer_cls = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    model_cls = GptOssModel

    def __init__(self, config) -> None:
        super().__init__(config)
        self.packed_modules_mapping = {
            **fused_moe_mapping(config.num_local_experts),
            **LlamaForCausalLM.packed_modules_mapping,
        }
