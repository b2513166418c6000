"""vLLM's multi-head latent attention (`MLAAttention`) as the MLA of an atom-models model
(DeepSeek-V2 / V3, Kimi-K2). [host: vllm]

vLLM's layer owns the latent KV cache (its MLA cache spec: kv_lora_rank + qk_rope_head_dim per
token), the cache write, and the choice between the absorbed decode and the expanded prefill, on
its MLA backends (CPU_MLA on the CPU build, AMX_MLA where the CPU has AMX tiles). It reads the
layer's `kv_b_proj` as a vLLM linear layer would present it: `weight` [H * (Dn + Dv), L],
`quant_method`, and a call returning `(output, bias)`; `KvBProj` presents ATOM's layer that way
without owning it.
"""

from __future__ import annotations

import torch
from torch import nn

from atom_models.layers.mla import MLAAttentionSpec


class KvBProj(nn.Module):
    """ATOM's kv_b_proj seen as a vLLM linear layer (unquantized). The ATOM module is held, not
    registered, so its parameter keeps its one checkpoint name; `weight` is read through it, so
    it is the materialized, loaded parameter."""

    def __init__(self, atom_linear: nn.Module) -> None:
        super().__init__()
        self._atom = (atom_linear,)
        self.quant_method = None

    @property
    def weight(self) -> torch.Tensor:
        return self._atom[0].weight

    @property
    def bias(self) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return self._atom[0](x), None


def _mla_attention_class():
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    return MLAAttention


class VllmMLAAttention(nn.Module):
    """An atom-models MLA impl backed by a vLLM `MLAAttention` layer named `layer_name`."""

    def __init__(
        self, spec: MLAAttentionSpec, kv_b_proj: nn.Module, vllm_config, layer_name: str, device
    ) -> None:
        super().__init__()
        self.spec = spec
        # The checkpoint's per-tensor scales; an fp8 latent cache uses "k" (host.apply_kv_scales).
        self.kv_scales: dict[str, float] = {}
        # atom-models builds on the `meta` device; vLLM's layer keeps real buffers (KV scales).
        with torch.device(device):
            self.attn = _mla_attention_class()(
                num_heads=spec.num_heads,
                scale=spec.scale,
                qk_nope_head_dim=spec.qk_nope_head_dim,
                qk_rope_head_dim=spec.qk_rope_head_dim,
                v_head_dim=spec.v_head_dim,
                q_lora_rank=None,  # read by no MLA backend this plugin was tested with
                kv_lora_rank=spec.kv_lora_rank,
                kv_b_proj=KvBProj(kv_b_proj),
                cache_config=vllm_config.cache_config,
                prefix=layer_name,
            )

    def set_kv_scale(self, which: str, value: float) -> None:
        self.kv_scales[which] = value

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        # T = tokens, H = heads: q_nope [T, H, Dn], q_pe [T, H, R], kv_c [T, L], k_pe [T, R]
        num_tokens = q_nope.shape[0]
        q = torch.cat((q_nope, q_pe), dim=-1)  # [T, H, Dn + R], vLLM's layout
        output_shape = torch.Size((num_tokens, self.spec.num_heads * self.spec.v_head_dim))
        return self.attn(q, kv_c, k_pe.unsqueeze(1), output_shape=output_shape)
