"""vLLM as the host of an atom-models model: its attention layers and its tensor-parallel group.
[host: vllm]

atom-models asks its host for each attention layer (`AttentionHost.make_attention`); under vLLM
that is vLLM's own `Attention` layer, so vLLM's KV-cache manager, forward context and attention
backend selection (ATOM's backend, through ATOM's platform) all apply unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention

from atom_models.layers.attention import AttentionSpec


class VllmAttention(nn.Module):
    """An atom-models attention impl backed by a vLLM `Attention` layer named `layer_name`."""

    def __init__(self, spec: AttentionSpec, vllm_config, layer_name: str, device) -> None:
        super().__init__()
        if spec.has_sinks:
            # vLLM's layer takes the sinks tensor at construction; atom-models passes it per call.
            raise NotImplementedError(
                f"{layer_name}: attention sinks are not wired to vLLM's attention layer yet"
            )
        # atom-models builds on the `meta` device; vLLM's layer keeps real buffers (KV scales).
        with torch.device(device):
            self.attn = Attention(
                num_heads=spec.num_heads,
                head_size=spec.head_size,
                scale=spec.scale,
                num_kv_heads=spec.num_kv_heads,
                cache_config=vllm_config.cache_config,
                logits_soft_cap=spec.soft_cap,
                per_layer_sliding_window=spec.sliding_window,
                prefix=layer_name,
            )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        # q [T, H*D], k / v [T, Hk*D] -> [T, H*D]
        return self.attn(q, k, v)


class VllmAttentionHost:
    """Builds each atom-models attention layer as a vLLM `Attention` layer.

    Layer names are the atom-models prefixes ("model.layers.3.self_attn.attn") under the wrapper's
    prefix: unique, and with the one layer index vLLM extracts to order the KV caches.
    """

    def __init__(self, vllm_config, prefix: str = "") -> None:
        self.vllm_config = vllm_config
        self.prefix = prefix
        self.device = torch.device(vllm_config.device_config.device)

    def make_attention(self, spec: AttentionSpec) -> nn.Module:
        name = f"{self.prefix}.{spec.prefix}" if self.prefix else spec.prefix
        return VllmAttention(spec, self.vllm_config, name, self.device)


class VllmTPGroup:
    """vLLM's tensor-parallel group as atom-models' `TensorParallelGroup` (rank, size, all-reduce,
    all-gather): ATOM's parallel layers then shard and communicate exactly as vLLM's do."""

    def __init__(self) -> None:
        from vllm.distributed import get_tp_group

        self.group = get_tp_group()
        self.rank = self.group.rank_in_group
        self.size = self.group.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.group.all_gather(x, dim)
