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


def _refuse_unsupported(vllm_config: Any) -> None:
    hint = f"; set {DISABLE_PLUGIN}=1 to run vLLM's own implementation"
    model = vllm_config.model_config
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ValueError(
            "ATOM's vLLM models do not support pipeline parallelism "
            f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size})" + hint
        )
    if model.quantization is not None:
        raise ValueError(
            f"ATOM's vLLM models load unquantized checkpoints only (quantization="
            f"{model.quantization!r})" + hint
        )
    if getattr(model, "enable_prompt_embeds", False):
        raise ValueError("ATOM's vLLM models take token ids, not prompt embeddings" + hint)
