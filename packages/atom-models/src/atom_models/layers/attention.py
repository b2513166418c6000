"""Host-agnostic attention.

Models build `Attention(...)` layers; what computes inside them comes from the host that builds the
model: ATOM's engine (paged KV cache + atom_kernels, the default `NativeAttentionHost`), vLLM (its
attention layer) or SGLang (RadixAttention). A host implements `AttentionHost.make_attention` and
installs itself with `attention_host(host)` around model construction. Hosts that serve
multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) also implement `make_mla_attention`
(`atom_models.layers.mla`).

Each attention layer also holds the per-tensor scales of an fp8 KV cache, `k_scale` / `v_scale`
(optional parameters: 1.0 unless the checkpoint gives them). Loading one hands its value to the
host's module (`impl.set_kv_scale("k" | "v", value)`), which uses it when its cache is fp8.
"""

from __future__ import annotations

import contextlib
import functools
import math
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
        from atom_models.native_host import NativeAttentionHost

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


def kv_scale_parameter(layer: nn.Module, which: str) -> nn.Parameter:
    """An optional per-tensor KV-cache scale of `layer` (`which`: "k" or "v"), default 1.0.

    Its weight loader takes a one-element checkpoint tensor, checks it, and passes the value on
    to `layer.impl.set_kv_scale(which, value)` when the host's module has that method.
    """
    param = nn.Parameter(torch.empty(()), requires_grad=False)
    param.optional = True  # atom_models.weights: not missing when the checkpoint lacks it
    param.default = 1.0
    param.weight_loader = functools.partial(_load_kv_scale, layer, which)
    return param


def _load_kv_scale(layer: nn.Module, which: str, param: nn.Parameter, loaded: torch.Tensor):
    if loaded.numel() != 1:
        raise ValueError(
            f"{which}_scale must be one per-tensor value, got shape {tuple(loaded.shape)}"
        )
    value = float(loaded.detach().float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{which}_scale must be a positive finite number, got {value}")
    param.data.fill_(value)
    set_kv_scale = getattr(layer.impl, "set_kv_scale", None)
    if set_kv_scale is not None:
        set_kv_scale(which, value)


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
        self.k_scale = kv_scale_parameter(self, "k")  # fp8 KV cache only
        self.v_scale = kv_scale_parameter(self, "v")
        self.impl = get_attention_host().make_attention(self.spec)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.impl(q, k, v, sinks)

    def forward_rope(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary_emb: nn.Module,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``self(*rotary_emb(positions, q, k, q_norm, k_norm), v, sinks)``.

        A host module that rotates q and k itself (``takes_rope``: ATOM's engine on a backend
        with the fused kernel, `NativeAttention`) gets them un-rotated, with the positions, and
        rotates them in the kernel that writes K and V into its cache. Other hosts (vLLM, SGLang:
        their attention writes their own cache) get the rotated q and k.
        """
        impl = self.impl
        takes_rope = getattr(impl, "takes_rope", None)
        if takes_rope is not None and takes_rope(q, rotary_emb, q_norm, k_norm):
            return impl(q, k, v, sinks, positions)
        q, k = rotary_emb(positions, q, k, q_norm, k_norm)
        return impl(q, k, v, sinks)
