"""`NativeAttentionHost`: ATOM's engine as the attention host (`atom_models.layers.attention`'s
default). A model built under it gets `NativeAttention` and `NativeMLAAttention` layers, each with
a paged cache the engine binds (`kv_cache`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from atom_models.native_host.attention import NativeAttention
from atom_models.native_host.mla import NativeMLAAttention

if TYPE_CHECKING:  # annotations only: atom_models.layers picks this host lazily
    from atom_models.layers.attention import AttentionSpec
    from atom_models.layers.mla import MLAAttentionSpec


class NativeAttentionHost:
    """ATOM's engine as the host. `builds_mtp_layers`: models build the multi-token-prediction
    layers their checkpoint carries (`atom_models.models.mtp`), the engine's MTP drafters; off,
    their weights and cache are not spent (vLLM and SGLang, which draft with their own modules,
    never get them)."""

    def __init__(self, builds_mtp_layers: bool = True) -> None:
        self.builds_mtp_layers = builds_mtp_layers

    def make_attention(self, spec: AttentionSpec) -> nn.Module:
        return NativeAttention(spec)

    def make_mla_attention(self, spec: MLAAttentionSpec, kv_b_proj: nn.Module) -> nn.Module:
        return NativeMLAAttention(spec, kv_b_proj)
