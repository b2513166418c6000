"""The vLLM model wrapper around atom-models' causal LMs. [host: vllm]

vLLM's ModelRegistry maps every architecture atom-models implements to `AtomForCausalLM` (see
`activation.register_models_and_backend`). vLLM constructs it from its config, loads the
checkpoint through `load_weights`, and calls `forward` / `compute_logits` inside its own forward
context; the atom-models model inside computes with vLLM's attention layers (and so, through
ATOM's platform, ATOM's attention backend) and vLLM's tensor-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atom_vllm_plugin.config import AtomVllmConfig
from atom_vllm_plugin.host import VllmAttentionHost, VllmTPGroup, share_attention_sinks
from atom_vllm_plugin.log import info_once
from atom_vllm_plugin.stats import counters


class AtomForCausalLM(nn.Module):
    """vLLM's text-generation model contract, computed by the atom-models class for the
    checkpoint's architecture (held as `self.model`)."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from atom_models import build_model, get_model_class

        self.atom_config = AtomVllmConfig.from_vllm_config(vllm_config)
        hf_config = vllm_config.model_config.hf_config
        model_cls = get_model_class(getattr(hf_config, "architectures", None))
        tp = VllmTPGroup()
        self.model = build_model(
            hf_config,
            dtype=self.atom_config.dtype,
            device=vllm_config.device_config.device,
            tp=tp,
            host=VllmAttentionHost(vllm_config, prefix),
        )
        share_attention_sinks(self.model)
        counters.models_built += 1
        info_once(
            "model %s.%s for %s (tp rank %d of %d; %s)",
            model_cls.__module__,
            model_cls.__qualname__,
            self.atom_config.model,
            tp.rank,
            tp.size,
            self.atom_config.summary(),
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]."""
        return self.model.model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] (the whole step, flattened) -> hidden states [T, hidden]."""
        if intermediate_tensors is not None or inputs_embeds is not None:
            # Refused at construction (AtomVllmConfig): pipeline parallelism, prompt embeddings.
            raise NotImplementedError("ATOM's vLLM models take token ids on a single PP stage")
        counters.model_forwards += 1
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, vocab] (gathered over the tensor-parallel ranks)."""
        return self.model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF checkpoint tensors by name; returns the loaded parameter names (as vLLM sees
        them, under `model.`) so vLLM's loader can check that every parameter was filled."""
        loaded = self.model.load_weights(weights)
        return {f"model.{name}" for name in loaded}
