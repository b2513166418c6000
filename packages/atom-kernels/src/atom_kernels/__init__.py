"""atom-kernels: LLM inference ops with a PyTorch reference, CPU and Triton backends.

Every op is one public function that checks its arguments and dispatches through
``atom_kernels.registry`` to the backend chosen for the tensor's device (``ATOM_KERNEL_BACKEND``).
"""

from atom_kernels.ops import (
    SamplerOutput,
    apply_penalties,
    apply_top_k_top_p_min_p,
    dequantize_fp8_block,
    dequantize_mxfp4,
    fp8_block_linear,
    fp8_linear,
    fused_add_rms_norm,
    fused_add_rms_norm_linear_silu_and_mul,
    fused_moe,
    gelu_and_mul,
    greedy_argmax,
    grouped_topk,
    linear,
    linear_silu_and_mul,
    mla_cache_write,
    mla_paged_attention,
    paged_attention,
    per_token_group_quant_fp8,
    rejection_sample,
    reshape_and_cache,
    rms_norm,
    rms_norm_linear,
    rotary_embedding,
    rotary_embedding_and_cache,
    sample,
    silu_and_mul,
    topk_softmax,
    topk_then_softmax,
)
from atom_kernels.registry import current_backend, get_op, register_op
from atom_kernels.rope import rope_cos_sin_cache, rope_inv_freq_and_attention_factor

__version__ = "0.1.0"

__all__ = [
    "SamplerOutput",
    "__version__",
    "apply_penalties",
    "apply_top_k_top_p_min_p",
    "current_backend",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "fp8_block_linear",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_add_rms_norm_linear_silu_and_mul",
    "fused_moe",
    "gelu_and_mul",
    "greedy_argmax",
    "get_op",
    "grouped_topk",
    "linear",
    "linear_silu_and_mul",
    "mla_cache_write",
    "mla_paged_attention",
    "paged_attention",
    "per_token_group_quant_fp8",
    "register_op",
    "rejection_sample",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_linear",
    "rope_cos_sin_cache",
    "rope_inv_freq_and_attention_factor",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "sample",
    "silu_and_mul",
    "topk_softmax",
    "topk_then_softmax",
]
