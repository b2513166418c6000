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

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        # T = tokens, D = head dim
        q, k, v = self.qkv_proj.split(qkv)
        # The per-head q/k RMSNorms run inside the rotary kernel (one launch for the three), and
        # on ATOM's engine the K/V cache write too (Attention.forward_rope).
        self.prefetch.start(qkv)
        out = self.attn.forward_rope(positions, q, k, v, self.rotary_emb, self.q_norm, self.k_norm)
        return self.o_proj(out)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3Model(LlamaModel):
    decoder_layer_cls = Qwen3DecoderLayer


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_cls = Qwen3Model
