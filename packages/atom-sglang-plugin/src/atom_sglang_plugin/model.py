"""The SGLang model wrapper around atom-models' causal LMs. [host: sglang]

With `--model-impl atom`, SGLang's model-architecture lookup answers `AtomForCausalLM` (see
`activation`). SGLang's loader constructs it as it constructs its own models
(`cls(config=hf_config, quant_config=...)`, under its default dtype and target device), fills it
through `load_weights`, and calls `forward(input_ids, positions, forward_batch)`; the atom-models
model inside computes with SGLang's `RadixAttention` layers and SGLang's tensor-parallel group,
and SGLang's `LogitsProcessor` turns its hidden states into `LogitsProcessorOutput`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.model_executor.runner_utils.forward_batch import set_forward_batch
from sglang.srt.runtime_context import get_server_args
from torch import nn

from atom_sglang_plugin.config import AtomSglangConfig
from atom_sglang_plugin.host import SglangAttentionHost, SglangTPGroup, apply_kv_scales
from atom_sglang_plugin.log import info_once


class AtomForCausalLM(nn.Module):
    """SGLang's causal-LM contract, computed by the atom-models class for the checkpoint's
    architecture (held as `self.model`)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        from atom_models import build_model, get_model_class

        server_args = get_server_args()
        self.atom_config = AtomSglangConfig.from_sglang(
            server_args, ModelConfig.from_server_args(server_args)
        )
        if quant_config is not None:
            raise ValueError(f"ATOM's SGLang models take no quant_config (got {quant_config})")
        self.config = config
        model_cls = get_model_class(getattr(config, "architectures", None))
        tp = SglangTPGroup()
        self.model = build_model(
            config,
            dtype=torch.get_default_dtype(),  # SGLang's loader sets it to the model's dtype
            device=torch.get_default_device(),  # and opens its target device around us
            tp=tp,
            host=SglangAttentionHost(prefix),
        )
        self.logits_processor = LogitsProcessor(config)
        info_once(
            "model %s.%s for %s (tp rank %d of %d; %s)",
            model_cls.__module__,
            model_cls.__qualname__,
            self.atom_config.model,
            tp.rank,
            tp.size,
            self.atom_config.summary(),
        )

    @property
    def lm_head(self) -> nn.Module:
        """The vocab-parallel LM head (`weight` [vocab / tp, hidden]) SGLang's logits use."""
        return self.model.lm_head

    def get_input_embeddings(self) -> nn.Module:
        return self.model.model.embed_tokens

    def get_attention_sliding_window_size(self) -> int | None:
        """SGLang's model-runner query (its own models answer it too): the sliding window of the
        RadixAttention layers built, in SGLang's exclusive count, or None without one."""
        windows = {m.sliding_window_size for m in self.modules() if isinstance(m, RadixAttention)}
        windows.discard(-1)
        return max(windows) if windows else None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch,
        input_embeds: torch.Tensor | None = None,
        get_embedding: bool = False,
        pp_proxy_tensors=None,
    ) -> LogitsProcessorOutput:
        """input_ids, positions [T] (the whole step, flattened) -> SGLang's logits output."""
        if input_embeds is not None or get_embedding or pp_proxy_tensors is not None:
            raise NotImplementedError(
                "ATOM's SGLang models take token ids and produce logits on a single PP stage"
            )
        with set_forward_batch(forward_batch):
            hidden_states = self.model(input_ids, positions)
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF checkpoint tensors by name; every parameter must be filled (atom-models'
        strict loader raises `CheckpointMismatchError` naming what is missing or unexpected).
        Returns the loaded parameter names as SGLang sees them (under `model.`)."""
        loaded = self.model.load_weights(weights)
        apply_kv_scales(self.model, self.lm_head.weight.device)
        return {f"model.{name}" for name in loaded}
