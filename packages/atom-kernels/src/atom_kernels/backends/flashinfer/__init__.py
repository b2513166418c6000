"""FlashInfer's kernels for the ops where they measured faster than ATOM's own (issue 42).

Optional: installed with the extra ``atom-kernels[flashinfer]`` (``flashinfer-python``, the
version vLLM 0.33 pins), never required. It is not a whole backend chosen per device like
``triton``: the Triton backend's op for an entry of ``MEASURED_FASTER`` calls FlashInfer's kernel
when ``use(op, tensor)`` says so, and its own otherwise. An op enters the table only from a
side-by-side measurement (``benchmarks/flashinfer_compare.py``, results in
``benchmarks/results/flashinfer/``), which the entry names.

``ATOM_FLASHINFER``: ``auto`` (default) uses every entry of the table when ``flashinfer`` imports
and the tensor is on a CUDA device; ``0`` never; a comma-separated list of op names only those.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from atom_kernels import envs

logger = logging.getLogger("atom_kernels")

# op -> the measurement that put it here (ATOM's step time over FlashInfer's, one H200); an entry
# may take FlashInfer's kernel only at the shapes where it won (mla.faster). Measured and left
# out (session 22, results/flashinfer/s22/):
# "sample" - FlashInfer's sampler alone is 1.2-5.4x faster than ATOM's filter kernels at
# vocabulary 128K / 152K, and ATOM's op with it inside takes 0.34-0.35x ATOM's own time at batch
# 256, but 1.25-1.32x at batch 1; in the engine Llama-3-8B decode (top-k 50, top-p 0.9) is 1.01x /
# 0.91x / 0.91x ATOM's step time at batch 1 / 64 / 256, while Qwen3-0.6B offline throughput falls
# to 0.40x (8,060 against 20,291 output tok/s). After ATOM's filter kernels got 1.3-1.9x faster
# (sessions 26-27), the same decode with it steps 1.01x / 1.01x / 1.02x ATOM's time at batch 1 /
# 64 / 256 (session 32, results/flashinfer/s32/). Ask for it with ATOM_FLASHINFER=sample.
# "prefill_attention" (prefill.py; the native host's attention layer calls it, fi_prefill.py) -
# the kernel is 1.10-1.33x faster than ATOM's at 4K-16K tokens (32/8 heads, d 128), but Llama-3-8B
# offline with 48 prompts of 4,000 tokens took 5.22-5.23 s against ATOM's 5.08-5.11 s (three
# alternated pairs), and 11.27 against 11.08-11.16 s at 8,000 tokens (session 31,
# results/flashinfer/s31/): the attention is about a tenth of those prefill steps. ATOM's kernel in
# the piecewise graphs FlashInfer's steps take (5.09 s) rules out the graph mode as the cause. Ask
# for it with ATOM_FLASHINFER=prefill_attention.
MEASURED_FASTER: dict[str, str] = {
    # mla.py; the native host's MLA layer, not a Triton op, calls it. The kernel is 2.2-2.7x
    # faster than ATOM's at 128 heads and 16-256 sequences; DeepSeek-V3 cut to 4 layers (2K
    # contexts, two alternated rounds, session 29, results/flashinfer/s29/) steps 1.02x / 1.03x
    # ATOM's speed at 64 sequences, 0.98x / 1.06x at 16, slower at 1 (FlashInfer's plan, 3.1 ms
    # of host time a step at 256 x 2K, is not hidden at one sequence). So `auto` takes it at 64
    # heads or more from 64 sequences (mla.AUTO_MIN_SEQS); ATOM_FLASHINFER=mla_decode wherever
    # the kernel alone measured faster.
    "mla_decode": "DeepSeek-V3 (4 layers), 128 heads, 64 sequences: 0.98x / 0.97x ATOM's step",
}

_AVAILABLE: bool | None = None
_LOGGED: set[str] = set()


def installed() -> bool:
    """Whether ``flashinfer`` can be imported (looked up once; imported only when used)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = importlib.util.find_spec("flashinfer") is not None
    return _AVAILABLE


def wanted(op: str) -> bool:
    """Whether ``ATOM_FLASHINFER`` lets ``op`` use FlashInfer."""
    if envs.ATOM_FLASHINFER == "auto":
        return op in MEASURED_FASTER
    return named(op)


def named(op: str) -> bool:
    """Whether ``ATOM_FLASHINFER`` names ``op`` itself (not through ``auto``'s table)."""
    setting = envs.ATOM_FLASHINFER
    return setting not in ("0", "off", "none", "", "auto") and op in {
        name.strip() for name in setting.split(",")
    }


def use(op: str, tensor: torch.Tensor) -> bool:
    """Whether ``op`` on ``tensor`` runs FlashInfer's kernel (logged once per op)."""
    if tensor.device.type != "cuda" or torch.version.hip or not wanted(op) or not installed():
        return False
    if op not in _LOGGED:
        _LOGGED.add(op)
        logger.info("atom_kernels: %s runs FlashInfer's kernel (ATOM_FLASHINFER=0: ATOM's)", op)
    return True
