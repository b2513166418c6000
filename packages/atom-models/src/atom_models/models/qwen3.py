"""Qwen3 (dense): Llama with per-head RMSNorm on q and k before rotary."""

from __future__ import annotations

import torch

from atom_models.layers.norm import RMSNorm
from atom_models.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    head_dim_of,
)


class Qwen3Attention(LlamaAttention):
    def __init__(self, config, layer_idx: int, prefix: str) -> None:
        super().__init__(config, layer_idx, prefix)
        self.head_dim = head_dim_of(config)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # T = tokens, D = head dim
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden_states))
        num_tokens = q.shape[0]
        q = self.q_norm(q.reshape(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        k = self.k_norm(k.reshape(num_tokens, -1, self.head_dim)).view(num_tokens, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
