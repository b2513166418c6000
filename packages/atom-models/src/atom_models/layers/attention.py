"""Host-agnostic attention.

Models build `Attention(...)` layers; what computes inside them comes from the host that builds the
model: ATOM's engine (paged KV cache + atom_kernels, the default `NativeAttentionHost`), vLLM (its
attention layer) or SGLang (RadixAttention). A host implements `AttentionHost.make_attention` and
installs itself with `attention_host(host)` around model construction. Hosts that serve
multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) also implement `make_mla_attention`
(`atom_models.layers.mla`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


@dataclass(frozen=True)
class AttentionSpec:
    """Everything a host needs to build one attention layer (per-rank head counts)."""

    num_heads: int
    head_size: int
    scale: float
    num_kv_heads: int
    layer_idx: int
    prefix: str
    sliding_window: int | None = None
    soft_cap: float | None = None
    has_sinks: bool = False


class AttentionHost(Protocol):
    def make_attention(self, spec: AttentionSpec) -> nn.Module:
        """A module computing `impl(q [T, H*D], k [T, Hk*D], v [T, Hk*D], sinks) -> [T, H*D]`."""
        ...


_current_host: AttentionHost | None = None


def get_attention_host() -> AttentionHost:
    if _current_host is None:
        from atom_models.native_attention import NativeAttentionHost

        return NativeAttentionHost()
    return _current_host


@contextlib.contextmanager
def attention_host(host: AttentionHost) -> Iterator[AttentionHost]:
    """Build models inside this block to get `host`'s attention layers."""
    global _current_host
    previous, _current_host = _current_host, host
    try:
        yield host
    finally:
        _current_host = previous


def layer_index(prefix: str) -> int:
    """The decoder-layer index in a prefix like 'model.layers.3.self_attn.attn'."""
    parts = prefix.split(".")
    for name, nxt in zip(parts, parts[1:], strict=False):
        if name == "layers" and nxt.isdigit():
            return int(nxt)
    raise ValueError(f"cannot find a layer index in attention prefix {prefix!r}")


class Attention(nn.Module):
    """Attention over this step's tokens (q, k, v already projected and rotated)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        prefix: str,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        has_sinks: bool = False,
    ) -> None:
        super().__init__()
        self.spec = AttentionSpec(
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            layer_idx=layer_index(prefix),
            prefix=prefix,
            sliding_window=sliding_window,
            soft_cap=soft_cap,
            has_sinks=has_sinks,
        )
        self.impl = get_attention_host().make_attention(self.spec)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.impl(q, k, v, sinks)
