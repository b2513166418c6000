"""vLLM as the host of an atom-models model: its attention layers and its tensor-parallel group.
[host: vllm]

atom-models asks its host for each attention layer (`AttentionHost.make_attention`); under vLLM
that is vLLM's own `Attention` layer, so vLLM's KV-cache manager, forward context and attention
backend selection (ATOM's backend, through ATOM's platform) all apply unchanged. So does vLLM's
`--kv-cache-dtype`: the layer reads `cache_config.cache_dtype` and sizes and allocates the cache;
the checkpoint's per-tensor k/v scales reach the layer's own `_k_scale` / `_v_scale` (see
`apply_kv_scales`).
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.attention import Attention

from atom_models.layers.attention import AttentionSpec
from atom_models.layers.mla import MLAAttentionSpec


class VllmAttention(nn.Module):
    """An atom-models attention impl backed by a vLLM `Attention` layer named `layer_name`."""

    def __init__(self, spec: AttentionSpec, vllm_config, layer_name: str, device) -> None:
        super().__init__()
        # atom-models builds on the `meta` device; vLLM's layer keeps real buffers (KV scales).
        with torch.device(device):
            # vLLM's layer hands its backend the sinks tensor [H] at construction, and backends
            # read it (or, like FlashInfer, a float32 copy made after loading) at every step,
            # as vLLM's own models expect of a parameter that weight loading fills in place.
            # ATOM's model owns the sinks parameter but is only materialized after this, so the
            # tensor is allocated here and `share_sinks` gives the parameter its storage.
            self.sinks: torch.Tensor | None = None
            extra = {}
            if spec.has_sinks:
                dtype = vllm_config.model_config.dtype
                self.sinks = extra["sinks"] = torch.empty(spec.num_heads, dtype=dtype)
            self.sinks_shared = False
            self.kv_scales: dict[str, float] = {}  # the checkpoint's, "k" / "v"
            self.attn = Attention(
                num_heads=spec.num_heads,
                head_size=spec.head_size,
                scale=spec.scale,
                num_kv_heads=spec.num_kv_heads,
                cache_config=vllm_config.cache_config,
                logits_soft_cap=spec.soft_cap,
                per_layer_sliding_window=spec.sliding_window,
                prefix=layer_name,
                **extra,
            )

    def set_kv_scale(self, which: str, value: float) -> None:
        """The checkpoint's per-tensor KV-cache scale ("k" or "v"); vLLM's layer gets it in
        `apply_kv_scales`, after vLLM's own post-load step (which resets its scales to 1.0 for
        a model without a quantization config)."""
        self.kv_scales[which] = value

    def share_sinks(self, param: nn.Parameter) -> None:
        """Make the model's materialized sinks parameter [H] use the storage vLLM's layer holds:
        the checkpoint's sinks, copied into the parameter by its weight loader, are then what
        vLLM's attention backend reads."""
        name = self.attn.layer_name
        if self.sinks is None:
            raise ValueError(f"{name}: this attention layer was built without sinks")
        if param.shape != self.sinks.shape or param.dtype != self.sinks.dtype:
            raise ValueError(
                f"{name}: sinks parameter {tuple(param.shape)} {param.dtype} does not match the "
                f"tensor vLLM's layer holds, {tuple(self.sinks.shape)} {self.sinks.dtype}"
            )
        param.data = self.sinks
        self.sinks_shared = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        # q [T, H*D], k / v [T, Hk*D] -> [T, H*D]
        # [H]: vLLM's backend already holds them (the same storage); data_ptr is not traceable
        if sinks is not None and not torch.compiler.is_compiling():
            assert self.sinks is not None and sinks.data_ptr() == self.sinks.data_ptr(), (
                f"{self.attn.layer_name}: the model's sinks are not the tensor vLLM's layer holds"
            )
        return self.attn(q, k, v)


def share_attention_sinks(model: nn.Module) -> None:
    """After `build_model`: give each sinks-taking attention layer its model's sinks parameter.

    The parameter is the `sinks` of the module that owns the layer as `attn` (GPT-OSS's
    `self_attn.sinks`, named after the checkpoint key). Raises ValueError for a layer whose sinks
    cannot be found, rather than letting vLLM attend with uninitialized sinks.
    """
    for module in model.modules():
        impl = getattr(getattr(module, "attn", None), "impl", None)
        if isinstance(impl, VllmAttention) and impl.sinks is not None:
            param = module._parameters.get("sinks")
            if param is not None:
                impl.share_sinks(param)
    for module in model.modules():
        if isinstance(module, VllmAttention) and module.sinks is not None:
            if not module.sinks_shared:
                raise ValueError(
                    f"{module.attn.layer_name}: the layer takes attention sinks but its parent "
                    "module has no `sinks` parameter to give vLLM's attention layer"
                )


def set_layer_kv_scale(layer: nn.Module, which: str, value: float) -> None:
    """Set a vLLM attention layer's per-tensor KV-cache scale: the device buffer its backends
    read (`_k_scale`), and the host copies (`_k_scale_float`, `_k_scale_cpu`)."""
    getattr(layer, f"_{which}_scale").fill_(value)
    setattr(layer, f"_{which}_scale_float", value)
    cpu = getattr(layer, f"_{which}_scale_cpu", None)
    if isinstance(cpu, torch.Tensor):
        cpu.fill_(value)


def apply_kv_scales(model: nn.Module) -> int:
    """After vLLM's post-load step: give each vLLM attention layer (standard and MLA) the
    checkpoint's k/v scales its ATOM layer loaded. Returns how many scales were set."""
    count = 0
    for module in model.modules():
        for which, value in getattr(module, "kv_scales", {}).items():
            attn = getattr(module, "attn", None)
            if attn is not None and hasattr(attn, f"_{which}_scale"):
                set_layer_kv_scale(attn, which, value)
                count += 1
    return count


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

    def make_mla_attention(self, spec: MLAAttentionSpec, kv_b_proj: nn.Module) -> nn.Module:
        """DeepSeek-style latent attention on vLLM's `MLAAttention` (its latent cache and MLA
        backends; ATOM's attention backend is for standard attention only)."""
        from atom_vllm_plugin.mla import VllmMLAAttention

        name = f"{self.prefix}.{spec.prefix}" if self.prefix else spec.prefix
        return VllmMLAAttention(spec, kv_b_proj, self.vllm_config, name, self.device)


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
