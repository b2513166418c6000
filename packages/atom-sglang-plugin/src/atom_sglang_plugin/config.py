"""Translation of SGLang's `ServerArgs` / `ModelConfig` into what ATOM builds its model from.

SGLang stays the runtime: it owns scheduling, the radix cache, KV-cache memory and CUDA graphs.
The fields below are what ATOM's model needs to know of those decisions (and what a user sees in
the startup log line); anything ATOM cannot honour is refused here, with the switch that
sidesteps it. Reads attributes only: SGLang is not imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from atom_sglang_plugin.switches import MODEL_IMPL


@dataclass(frozen=True)
class AtomSglangConfig:
    model: str  # checkpoint directory (or hub id) SGLang loads
    dtype: torch.dtype  # weights and activations (SGLang's resolved `--dtype`)
    device: str  # "cuda", "cpu", ...
    context_length: int  # longest prompt + completion
    tp_size: int
    ep_size: int  # MoE expert parallelism
    attention_backend: str  # SGLang's backend computing RadixAttention ("auto" when SGLang picks)
    kv_cache_dtype: str  # SGLang's cache dtype name ("auto", "fp8_e4m3", ...)
    page_size: int  # tokens per KV-cache page
    max_running_requests: int | None  # None: SGLang sizes it from memory
    chunked_prefill_size: int | None
    mem_fraction_static: float | None
    radix_cache: bool  # prefix reuse through SGLang's radix tree

    @classmethod
    def from_sglang(cls, server_args: Any, model_config: Any) -> AtomSglangConfig:
        """Read the fields from SGLang's server arguments and model config; raises ValueError
        for what ATOM cannot run."""
        _refuse_unsupported(server_args, model_config)
        return cls(
            model=str(model_config.model_path),
            dtype=model_config.dtype,
            device=str(server_args.device),
            context_length=int(model_config.context_len),
            tp_size=int(server_args.tp_size),
            ep_size=int(server_args.ep_size),
            attention_backend=str(server_args.attention_backend or "auto"),
            kv_cache_dtype=str(server_args.kv_cache_dtype),
            page_size=int(server_args.page_size or 1),
            max_running_requests=server_args.max_running_requests,
            chunked_prefill_size=server_args.chunked_prefill_size,
            mem_fraction_static=server_args.mem_fraction_static,
            radix_cache=not bool(server_args.disable_radix_cache),
        )

    def summary(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"dtype={dtype} device={self.device} context_length={self.context_length} "
            f"tp={self.tp_size} ep={self.ep_size} attention_backend={self.attention_backend} "
            f"kv_cache_dtype={self.kv_cache_dtype} page_size={self.page_size} "
            f"max_running_requests={self.max_running_requests} "
            f"chunked_prefill_size={self.chunked_prefill_size} "
            f"mem_fraction_static={self.mem_fraction_static} radix_cache={self.radix_cache}"
        )


def _refuse_unsupported(server_args: Any, model_config: Any) -> None:
    hint = f"; drop --model-impl {MODEL_IMPL} to run SGLang's own implementation"
    if int(getattr(server_args, "pp_size", 1) or 1) != 1:
        raise ValueError(
            f"ATOM's SGLang models do not support pipeline parallelism (pp_size="
            f"{server_args.pp_size})" + hint
        )
    quantization = getattr(model_config, "quantization", None)
    if quantization is not None:
        raise ValueError(
            f"ATOM's SGLang models load unquantized checkpoints only (quantization="
            f"{quantization!r})" + hint
        )
