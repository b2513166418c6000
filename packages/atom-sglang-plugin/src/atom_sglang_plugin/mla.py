"""SGLang's `RadixAttention` as the multi-head latent attention of an atom-models model
(DeepSeek-V2 / V3, Kimi-K2), in the absorbed form SGLang's own DeepSeek models use. [host: sglang]

SGLang keeps MLA's KV cache in its MLA pool (one "head" of kv_lora_rank + qk_rope_head_dim values
per token, chosen from the checkpoint's architecture) and attends with a RadixAttention of one KV
head whose keys are (latent, rope key) and whose values are the latent. The query goes into the
latent space through kv_b_proj's key half (W_UK) first, the output back through its value half
(W_UV), so every SGLang backend that serves its own DeepSeek models serves this layer too.
"""

from __future__ import annotations

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.runner_utils.forward_batch import get_forward_batch
from torch import nn

from atom_models.layers.mla import MLAAttentionSpec


class SglangMLAAttention(nn.Module):
    """An atom-models MLA impl backed by SGLang's `RadixAttention` over its MLA KV pool."""

    def __init__(self, spec: MLAAttentionSpec, kv_b_proj: nn.Module, prefix: str) -> None:
        super().__init__()
        self.spec = spec
        # Held, not registered: kv_b_proj is the attention module's (and its checkpoint name).
        self._kv_b_proj = (kv_b_proj,)
        self.kv_scales: dict[str, float] = {}  # the checkpoint's (host.apply_kv_scales)
        self.attn = RadixAttention(
            num_heads=spec.num_heads,
            head_dim=spec.kv_lora_rank + spec.qk_rope_head_dim,
            scaling=spec.scale,
            num_kv_heads=1,
            layer_id=spec.layer_idx,
            v_head_dim=spec.kv_lora_rank,
            prefix=prefix,
        )

    def set_kv_scale(self, which: str, value: float) -> None:
        self.kv_scales[which] = value

    def forward(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor
    ) -> torch.Tensor:
        # T = tokens, H = heads, Dn / R / Dv = nope / rope / value head dims, L = kv_lora_rank
        spec = self.spec
        num_tokens = q_nope.shape[0]
        weight = self._kv_b_proj[0].weight.view(
            spec.num_heads, spec.qk_nope_head_dim + spec.v_head_dim, spec.kv_lora_rank
        )
        w_uk, w_uv = weight.split([spec.qk_nope_head_dim, spec.v_head_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        q = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, L + R]
        k = torch.cat((kv_c, k_pe), dim=-1).unsqueeze(1)  # [T, 1, L + R]
        v = kv_c.unsqueeze(1)  # [T, 1, L]
        out = self.attn(q, k, v, get_forward_batch())  # [T, H * L]
        out = out.view(num_tokens, spec.num_heads, spec.kv_lora_rank)
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, Dv]
        return out.reshape(num_tokens, -1)
