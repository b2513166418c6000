"""Torch reference: MoE routing and the fused expert computation (per-expert gather / scatter)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atom_kernels.backends.torch.int_quant import dequantize_wna16
from atom_kernels.backends.torch.quant import (
    dequantize_fp8_block,
    dequantize_fp8_channel,
    mxfp4_weight,
)
from atom_kernels.registry import register_op


@register_op("topk_softmax", "torch")
def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)  # [T, K]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@register_op("topk_then_softmax", "torch")
def topk_then_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = router_logits.float().topk(top_k, dim=-1)  # [T, K]
    return torch.softmax(values, dim=-1), ids.to(torch.int32)


@register_op("grouped_topk", "torch")
def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str,
    e_score_correction_bias: torch.Tensor | None,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # T = tokens, E = experts, G = groups
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    num_tokens, num_experts = scores.shape
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float()  # [T, E], ranks experts only
        grouped = choice.view(num_tokens, num_expert_group, -1)  # [T, G, E/G]
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    else:
        choice = scores
        group_scores = choice.view(num_tokens, num_expert_group, -1).amax(dim=-1)  # [T, G]
    group_ids = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
    expert_mask = group_mask.repeat_interleave(num_experts // num_expert_group, dim=1)  # [T, E]
    ids = choice.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices  # [T, K]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def _activate(
    gate_up: torch.Tensor, activation: str, interleaved: bool, alpha: float, limit: float
) -> torch.Tensor:
    """[n, 2I] -> [n, I] in fp32."""
    gate_up = gate_up.float()
    if interleaved:
        gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    gate = gate.clamp(max=limit)  # swiglu_oai
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)


def _dequantize(
    weight: torch.Tensor,
    scale: torch.Tensor,
    quant: str,
    block_size: tuple[int, int] | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """One expert's quantized weight (see ``atom_kernels.fused_moe``) -> [N, K] in dtype."""
    if quant == "fp8_block":
        return dequantize_fp8_block(weight, scale, block_size, dtype)
    if quant == "fp8_channel":
        return dequantize_fp8_channel(weight, scale, dtype)
    return mxfp4_weight(weight, scale, dtype)


def _at(t: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if t is None else t[expert]


@register_op("fused_moe", "torch")
def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    gate_up_interleaved: bool,
    swiglu_alpha: float,
    swiglu_limit: float,
    quant: str | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    # T = tokens, K = experts per token, H = hidden size
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    expert_of = topk_ids.reshape(-1).long()  # [T*K]: one (token, slot) pair per entry
    weight_of = topk_weights.reshape(-1).float()
    # Each pair's weighted expert output gets its own row; a token's K rows are summed at the end.
    pair_out = hidden_states.new_zeros(num_tokens * top_k, w2.shape[1], dtype=torch.float32)
    # Group the pairs by expert: one sort, one host sync for the counts. Pairs with id -1 (not
    # computed here) sort first and are skipped: their rows stay zero.
    order = expert_of.argsort(stable=True)
    skipped, *counts = torch.bincount(expert_of + 1, minlength=num_experts + 1).tolist()
    start = skipped
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start : start + count]
        start += count
        x = hidden_states[pairs // top_k]  # [n, H] gather
        w13_e, w2_e = w13[expert], w2[expert]
        if quant == "wna16":
            bits = 32 * w13_e.shape[1] // x.shape[1]
            w13_e = dequantize_wna16(
                w13_e, w13_scale[expert], _at(w13_zeros, expert), None, bits, x.dtype
            )
            w2_e = dequantize_wna16(
                w2_e, w2_scale[expert], _at(w2_zeros, expert), None, bits, x.dtype
            )
        elif quant is not None:  # the dequantized model: only the routed experts, one at a time
            w13_e = _dequantize(w13_e, w13_scale[expert], quant, block_size, x.dtype)
            w2_e = _dequantize(w2_e, w2_scale[expert], quant, block_size, x.dtype)
        gate_up = F.linear(x, w13_e, None if w13_bias is None else w13_bias[expert])
        act = _activate(gate_up, activation, gate_up_interleaved, swiglu_alpha, swiglu_limit)
        y = F.linear(act.to(x.dtype), w2_e, None if w2_bias is None else w2_bias[expert])
        pair_out[pairs] = y.float() * weight_of[pairs, None]  # [n, H] scatter
    return pair_out.view(num_tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)
