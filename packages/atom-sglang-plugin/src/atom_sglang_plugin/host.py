"""SGLang as the host of an atom-models model: RadixAttention and SGLang's tensor-parallel group.
[host: sglang]

atom-models asks its host for each attention layer (`AttentionHost.make_attention`); under SGLang
that is SGLang's own `RadixAttention`, so SGLang's KV-cache pools, radix cache and the attention
backend SGLang selected (`--attention-backend`) all apply unchanged. The step's `ForwardBatch`
reaches the layers through SGLang's own current-batch scope (`set_forward_batch`), which the
wrapper opens around each forward, never through the atom-models forward signatures. SGLang's
`--kv-cache-dtype` sizes its pools and reaches its backends unchanged; the checkpoint's per-tensor
k/v scales go to each RadixAttention's `k_scale` / `v_scale` (see `apply_kv_scales`), where
SGLang's own models put them and its backends read them.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.runner_utils.forward_batch import get_forward_batch
from sglang.srt.runtime_context import get_parallel
from torch import nn

from atom_models.layers.attention import AttentionSpec
from atom_models.layers.mla import MLAAttentionSpec


class SglangAttention(nn.Module):
    """An atom-models attention impl backed by SGLang's `RadixAttention` (held as `self.attn`)."""

    def __init__(self, spec: AttentionSpec, prefix: str) -> None:
        super().__init__()
        if spec.has_sinks:
            # Sinks reach SGLang's backends as a per-call kwarg that only some backends accept.
            raise NotImplementedError(f"{prefix}: attention sinks are not wired to SGLang yet")
        self.kv_scales: dict[str, float] = {}  # the checkpoint's, "k" / "v"
        self.attn = RadixAttention(
            num_heads=spec.num_heads,
            head_dim=spec.head_size,
            scaling=spec.scale,
            num_kv_heads=spec.num_kv_heads,
            layer_id=spec.layer_idx,
            logit_cap=spec.soft_cap or 0.0,
            # SGLang's window counts the tokens before the current one (its own models pass
            # HF's `sliding_window - 1`); atom-models' spec carries HF's value.
            sliding_window_size=spec.sliding_window - 1 if spec.sliding_window else -1,
            prefix=prefix,
        )

    def set_kv_scale(self, which: str, value: float) -> None:
        """The checkpoint's per-tensor KV-cache scale ("k" or "v"), for `apply_kv_scales`."""
        self.kv_scales[which] = value

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        # q [T, H*D], k / v [T, Hk*D] -> [T, H*D]
        return self.attn(q, k, v, get_forward_batch())


def apply_kv_scales(model: nn.Module, device: torch.device) -> int:
    """After loading: set each RadixAttention's `k_scale` / `v_scale` (a float32 tensor on
    `device`) and `k_scale_float` / `v_scale_float` to the checkpoint's scales, as SGLang's
    kv-cache quant method does for its own models. Returns how many scales were set."""
    count = 0
    for module in model.modules():
        for which, value in getattr(module, "kv_scales", {}).items():
            attn = getattr(module, "attn", None)
            if isinstance(attn, RadixAttention):
                setattr(attn, f"{which}_scale", torch.tensor(value, device=device))
                setattr(attn, f"{which}_scale_float", value)
                count += 1
    return count


class SglangAttentionHost:
    """Builds each atom-models attention layer as an SGLang `RadixAttention`.

    `layer_id` is the decoder-layer index, the index SGLang's KV-cache pools are laid out by.
    """

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def make_attention(self, spec: AttentionSpec) -> nn.Module:
        name = f"{self.prefix}.{spec.prefix}" if self.prefix else spec.prefix
        return SglangAttention(spec, name)

    def make_mla_attention(self, spec: MLAAttentionSpec, kv_b_proj: nn.Module) -> nn.Module:
        """DeepSeek-style latent attention: a RadixAttention over SGLang's MLA KV pool."""
        from atom_sglang_plugin.mla import SglangMLAAttention

        name = f"{self.prefix}.{spec.prefix}" if self.prefix else spec.prefix
        return SglangMLAAttention(spec, kv_b_proj, name)


class SglangTPGroup:
    """SGLang's tensor-parallel group as atom-models' `TensorParallelGroup` (rank, size,
    all-reduce, all-gather): ATOM's parallel layers then shard and communicate as SGLang's do."""

    def __init__(self) -> None:
        self.group = get_parallel().tp_group  # SGLang's GroupCoordinator
        self.rank = self.group.rank_in_group
        self.size = self.group.world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return self.group.all_gather(x, dim)
