"""Host-agnostic multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi-K2).

The model projects and rotates; what attends comes from the host, as for `Attention`: a host
implements `make_mla_attention(spec, kv_b_proj)` (ATOM's engine: a paged latent cache of
`kv_lora_rank + qk_rope_head_dim` values per token; vLLM / SGLang: their own MLA layers). The host
gets the layer's `kv_b_proj` (the latent -> per-head nope-key and value up-projection) because the
absorbed form of attention multiplies the query and the output by its two halves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from atom_models.layers.attention import get_attention_host, kv_scale_parameter, layer_index


@dataclass(frozen=True)
class MLAAttentionSpec:
    """Everything a host needs to build one MLA layer (per-rank head count).

    L = kv_lora_rank, R = qk_rope_head_dim, Dn = qk_nope_head_dim, Dv = v_head_dim. The cache
    holds L + R values per token (one shared "head"); `kv_b_proj.weight` is [H * (Dn + Dv), L],
    head-major, each head's Dn key rows before its Dv value rows.
    """

    num_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float
    layer_idx: int
    prefix: str

    @property
    def cache_size(self) -> int:
        """Values cached per token: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


class MLAAttentionHost(Protocol):
    def make_mla_attention(self, spec: MLAAttentionSpec, kv_b_proj: nn.Module) -> nn.Module:
        """A module computing
        `impl(q_nope [T, H, Dn], q_pe [T, H, R], kv_c [T, L], k_pe [T, R]) -> [T, H * Dv]`
        (q_pe and k_pe rotated, kv_c after kv_a_layernorm)."""
        ...


class MLAAttention(nn.Module):
    """MLA over this step's tokens: queries split into their nope and rope parts, the normed
    latent and the rotated rope key of every new token."""

    def __init__(
        self,
        num_heads: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        kv_lora_rank: int,
        scale: float,
        kv_b_proj: nn.Module,
        *,
        prefix: str,
    ) -> None:
        super().__init__()
        self.spec = MLAAttentionSpec(
            num_heads=num_heads,
            qk_nope_head_dim=qk_nope_head_dim,
            qk_rope_head_dim=qk_rope_head_dim,
            v_head_dim=v_head_dim,
            kv_lora_rank=kv_lora_rank,
            scale=scale,
            layer_idx=layer_index(prefix),
            prefix=prefix,
        )
        host = get_attention_host()
        if not hasattr(host, "make_mla_attention"):
            raise NotImplementedError(
                f"attention host {type(host).__name__} cannot build multi-head latent attention "
                "(DeepSeek-V2/V3, Kimi-K2): it has no make_mla_attention"
            )
        # An fp8 latent cache has one scale, k_scale (vLLM's convention); v_scale is accepted
        # from checkpoints that carry it, and unused.
        self.k_scale = kv_scale_parameter(self, "k")
        self.v_scale = kv_scale_parameter(self, "v")
        # Hosts read kv_b_proj's weight (absorbed into the query and output): a quantized
        # checkpoint's is dequantized to the model dtype after loading.
        kv_b_proj.dense_weight_required = True
        self.impl = host.make_mla_attention(self.spec, kv_b_proj)

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        return self.impl(q_nope, q_pe, kv_c, k_pe)
