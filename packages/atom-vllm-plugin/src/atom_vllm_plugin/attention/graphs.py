"""CUDA graphs and ATOM's attention backend: what vLLM may capture. [host: vllm]

vLLM 0.32 resolves its cudagraph mode from the least graph support of the attention backends in
use (`AttentionMetadataBuilder.get_cudagraph_support`, then
`CompilationConfig.resolve_cudagraph_mode_and_sizes`). Its default on a GPU, FULL_AND_PIECEWISE,
needs two things of a model:

- FULL graphs for decode batches: the attention kernels themselves are captured, so they must
  read the batch only on the device, from buffers at fixed addresses. atom_kernels' Triton ops do
  (`paged_attention` launches both its kernels sized from shapes alone; `reshape_and_cache` skips
  slot -1 on the device), and ATOM's metadata are views of vLLM's persistent input buffers,
  which the runner rewrites before each replay. A backend declaring NEVER makes vLLM drop FULL
  graphs (to PIECEWISE, or to NONE when the model is not compiled).
- PIECEWISE graphs around attention for prefill and mixed batches: vLLM splits the model's
  torch.compile graph at its attention ops, so the model must be compiled
  (`support_torch_compile`; see `atom_vllm_plugin.model`). An uncompiled model loses them: the
  V2 model runner turns FULL_AND_PIECEWISE into FULL_DECODE_ONLY (`piecewise_capture_available`).
"""

from __future__ import annotations

from typing import Any

# The ops ATOM's backend runs inside a step, and the atom_kernels backends whose implementations
# of them never read the device on the host (the torch reference reads seq_lens with .tolist()).
GRAPH_OPS = ("paged_attention", "reshape_and_cache")
CAPTURE_SAFE_BACKENDS = ("triton",)


def capture_unsafe_reason(device: Any) -> str | None:
    """Why ATOM's attention cannot be captured in a CUDA graph on `device`, or None when it can:
    every op in GRAPH_OPS resolves (atom_kernels' registry, with its fallbacks) to a capture-safe
    backend's implementation."""
    import torch

    import atom_kernels

    device = torch.device(device)
    if device.type != "cuda":
        return f"no CUDA graphs on device type {device.type!r}"
    for op in GRAPH_OPS:
        module = getattr(atom_kernels.get_op(op, device), "__module__", "") or ""
        backend = module.removeprefix("atom_kernels.backends.").split(".", 1)[0]
        if backend not in CAPTURE_SAFE_BACKENDS:
            return f"atom_kernels runs {op} on its {backend or module!r} backend"
    return None


def full_graphs_are_decode_only(cudagraph_mode: Any) -> bool:
    """Whether every FULL graph vLLM captures in this mode is replayed for uniform decode batches
    only (FULL_AND_PIECEWISE, FULL_DECODE_ONLY), rather than for mixed batches too (FULL)."""
    from vllm.config import CUDAGraphMode

    return cudagraph_mode is None or cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL
