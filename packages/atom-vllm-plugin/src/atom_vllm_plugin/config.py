"""Translation of vLLM's `VllmConfig` into the configuration ATOM builds its model from.

vLLM stays the runtime: it owns scheduling, the KV cache and memory. The fields below are what
ATOM's model and attention need to know of those decisions (and what a user sees in the startup
log line); anything ATOM cannot honour is refused here, with the switch that sidesteps it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from atom_vllm_plugin.switches import DISABLE_PLUGIN


@dataclass(frozen=True)
class AtomVllmConfig:
    model: str  # checkpoint directory (or hub id) vLLM loads
    dtype: torch.dtype  # weights and activations
    device: str  # "cuda", "cpu", ...
    max_model_len: int  # longest prompt + completion
    max_num_seqs: int  # most sequences in one step
    max_num_batched_tokens: int  # token budget of one step
    block_size: int  # tokens per KV-cache block
    kv_cache_dtype: str  # vLLM's cache dtype name ("auto", "fp8", ...)
    tensor_parallel_size: int
    enable_expert_parallel: bool  # MoE: whole experts per rank, not every expert split over TP
    enable_prefix_caching: bool
    gpu_memory_utilization: float

    @classmethod
    def from_vllm_config(cls, vllm_config: Any) -> AtomVllmConfig:
        """Read the fields from vLLM's config; raises ValueError for what ATOM cannot run."""
        model = vllm_config.model_config
        cache = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        scheduler = vllm_config.scheduler_config
        _refuse_unsupported(vllm_config)
        return cls(
            model=str(model.model),
            dtype=model.dtype,
            device=str(vllm_config.device_config.device_type),
            max_model_len=int(model.max_model_len),
            max_num_seqs=int(scheduler.max_num_seqs),
            max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
            block_size=int(cache.block_size),
            kv_cache_dtype=str(cache.cache_dtype),
            tensor_parallel_size=int(parallel.tensor_parallel_size),
            enable_expert_parallel=bool(parallel.enable_expert_parallel),
            enable_prefix_caching=bool(cache.enable_prefix_caching),
            gpu_memory_utilization=float(cache.gpu_memory_utilization),
        )

    def summary(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"dtype={dtype} device={self.device} max_model_len={self.max_model_len} "
            f"max_num_seqs={self.max_num_seqs} "
            f"max_num_batched_tokens={self.max_num_batched_tokens} "
            f"block_size={self.block_size} kv_cache_dtype={self.kv_cache_dtype} "
            f"tp={self.tensor_parallel_size} ep={self.enable_expert_parallel} "
            f"prefix_caching={self.enable_prefix_caching} "
            f"gpu_memory_utilization={self.gpu_memory_utilization}"
        )


def unsupported_reason(vllm_config: Any) -> str | None:
    """Why ATOM's model cannot serve this configuration (vLLM's own implementation then does), or
    None when it can. Each reason names the setting, so the WARNING line says what to change."""
    model = vllm_config.model_config
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp != 1:
        return f"pipeline parallelism (pipeline_parallel_size={pp})"
    quantization = quantization_unsupported(model)
    if quantization is not None:
        return quantization
    if getattr(model, "enable_prompt_embeds", False):
        return "prompt embeddings (enable_prompt_embeds=True)"
    if getattr(vllm_config, "lora_config", None) is not None:
        return "LoRA adapters (enable_lora=True)"
    runner = getattr(model, "runner_type", "generate")
    convert = getattr(model, "convert_type", "none")
    if runner != "generate" or convert != "none":
        return f"a non-generative runner (runner={runner}, convert={convert})"
    return None


def quantization_unsupported(model_config: Any) -> str | None:
    """Why ATOM's model cannot run this checkpoint's quantization, or None when it can.

    ATOM runs a quantized checkpoint when atom-models loads its `quantization_config` (FP8 block /
    per-tensor / per-channel, compressed-tensors FP8, ModelOpt FP8, MXFP4 experts): `build_model`
    builds ATOM's quantized layers from the checkpoint's own config, so the quant_config vLLM
    built from it (`VllmConfig.quant_config`) is never used. Quantization ATOM does not load,
    and vLLM's online quantization of an unquantized checkpoint (`--quantization fp8` on bf16
    weights), go to vLLM's own model.
    """
    from atom_models.quantization import parse_quant_config, quantization_config_of

    raw = quantization_config_of(model_config.hf_config)
    if raw is None:
        if model_config.quantization is not None:
            return (
                f"online quantization (quantization={model_config.quantization!r} of an "
                "unquantized checkpoint)"
            )
        return None
    try:
        parse_quant_config(model_config.hf_config)
    except ValueError as error:
        method = raw.get("quant_method", model_config.quantization)
        return f"a quantized checkpoint (quantization={method!r}: {error})"
    return None


def _refuse_unsupported(vllm_config: Any) -> None:
    # The wrapper hands these configurations to vLLM's own model before it gets here
    # (`AtomForCausalLM.__new__`); this guards anyone building ATOM's model directly.
    reason = unsupported_reason(vllm_config)
    if reason is not None:
        raise ValueError(
            f"ATOM's vLLM models do not support {reason}; vLLM's own implementation serves it "
            f"(or set {DISABLE_PLUGIN}=1)"
        )
