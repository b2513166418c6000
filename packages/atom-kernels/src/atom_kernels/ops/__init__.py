"""Public ops: each checks its arguments, then calls the registry's implementation."""

from atom_kernels.ops.activation import gelu_and_mul, silu_and_mul
from atom_kernels.ops.attention import paged_attention
from atom_kernels.ops.cache import reshape_and_cache
from atom_kernels.ops.int_quant import dequantize_wna16, int8_linear, wna16_linear
from atom_kernels.ops.linear import (
    fused_add_rms_norm_linear_silu_and_mul,
    linear,
    linear_silu_and_mul,
    rms_norm_linear,
)
from atom_kernels.ops.mla import mla_cache_write, mla_paged_attention
from atom_kernels.ops.moe import fused_moe, grouped_topk, topk_softmax, topk_then_softmax
from atom_kernels.ops.norm import fused_add_rms_norm, fused_add_rms_norm_, rms_norm
from atom_kernels.ops.prefetch import l2_prefetch, l2_spans
from atom_kernels.ops.quant import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    fp8_block_linear,
    fp8_linear,
    per_token_group_quant_fp8,
)
from atom_kernels.ops.rotary import rotary_embedding, rotary_embedding_and_cache
from atom_kernels.ops.sampling import (
    SamplerOutput,
    apply_penalties,
    apply_top_k_top_p_min_p,
    greedy_argmax,
    sample,
)
from atom_kernels.ops.spec_decode import rejection_sample

__all__ = [
    "apply_penalties",
    "apply_top_k_top_p_min_p",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_wna16",
    "fp8_block_linear",
    "fp8_linear",
    "fused_add_rms_norm",
    "fused_add_rms_norm_",
    "fused_add_rms_norm_linear_silu_and_mul",
    "fused_moe",
    "gelu_and_mul",
    "greedy_argmax",
    "grouped_topk",
    "int8_linear",
    "l2_prefetch",
    "l2_spans",
    "linear",
    "linear_silu_and_mul",
    "mla_cache_write",
    "mla_paged_attention",
    "paged_attention",
    "per_token_group_quant_fp8",
    "rejection_sample",
    "reshape_and_cache",
    "rms_norm",
    "rms_norm_linear",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "sample",
    "SamplerOutput",
    "silu_and_mul",
    "topk_softmax",
    "topk_then_softmax",
    "wna16_linear",
]
