"""Triton MoE routing: a token's router logits to its top-k experts and their weights in one
kernel (issue 37), where the torch reference runs a softmax, a top-k, a sum and a division as
separate kernels (several more for DeepSeek's grouped top-k): at batch 1 each of those is a
launch of a few microseconds, 94 times a Qwen3-235B step.

One program a token. Its E logits sit in registers (E <= MAX_EXPERTS); the top-k is k rounds of
"the largest, the lowest index among equal ones, then mask it out", so the ids come largest
first, as `torch.topk` gives them (among equal values torch's order is open: a tie at the k-th
place may pick another expert of the same weight). Scores are computed in fp32 as the reference
does.

- `topk_softmax`: softmax over the E logits, the k largest, optionally renormalized (Qwen3-MoE,
  Mixtral).
- `topk_then_softmax`: the k largest logits, then softmax over those k (GPT-OSS).
- `grouped_topk`: the logits as a [groups, group size] tile; scores by softmax or sigmoid; with
  a correction bias a group scores the sum of its two best corrected scores, else its best; the
  `topk_group` best groups' experts compete for the k (by corrected score); weights are the
  uncorrected scores, renormalized (+1e-20) and scaled (DeepSeek-V3, Kimi-K2, GLM-4-MoE).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_kernels import envs
from atom_kernels.backends.torch import moe as reference
from atom_kernels.backends.triton import pdl
from atom_kernels.backends.triton.common import next_pow2

# The most experts a token's logits may have for one program to hold them (Kimi-K2: 384).
MAX_EXPERTS = 4096
# `ATOM_TRITON_ROUTING` (read at import; tests set ENABLED): `0`, the launchers route with the
# torch reference. NOTE (one H200, benchmarks/results/int-quant/s25/routing.json, CUDA graphs,
# alternated with the torch ops, each checked against them first): at one token 1.9 / 3.2 /
# 4.1 / 1.2 us against 16.3 / 50.8 / 45.4 / 13.1 us (Qwen3-235B, DeepSeek-V3, Kimi-K2, GPT-OSS),
# 8-23x faster at 1-512 tokens: on by default.
ENABLED = envs.ATOM_TRITON_ROUTING


@triton.jit
def _top_k(values, index, avail, K: tl.constexpr, K_P2: tl.constexpr, BIG: tl.constexpr):
    """The K largest of `values` ([N]) among the `avail` lanes and their `index` ([N]), largest
    first; among equal values the lowest index first (torch.topk leaves that order open). NaN
    ranks above everything (as torch orders it), so the ids are always available lanes, each
    once (K <= the available lanes: the public ops check it)."""
    values = tl.where(values != values, float("inf"), values)
    ks = tl.arange(0, K_P2)
    top = tl.full([K_P2], float("-inf"), tl.float32)
    ids = tl.zeros([K_P2], tl.int32)
    for k in tl.static_range(K):
        best = tl.max(tl.where(avail, values, float("-inf")), 0)
        at = tl.min(tl.where(avail & (values == best), index, BIG), 0)
        top = tl.where(ks == k, best, top)
        ids = tl.where(ks == k, at, ids)
        avail = avail & (index != at)
    return top, ids


@triton.jit
def _store(weights_ptr, ids_ptr, row, weights, ids, K: tl.constexpr, K_P2: tl.constexpr):
    ks = tl.arange(0, K_P2)
    tl.store(weights_ptr + row * K + ks, weights, mask=ks < K)
    tl.store(ids_ptr + row * K + ks, ids, mask=ks < K)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    stride_t,
    weights_ptr,
    ids_ptr,
    num_experts,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    SOFTMAX_FIRST: tl.constexpr,  # softmax over all E then top-k; else top-k then softmax over k
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched early behind the router GEMM (pdl.py): nothing read before this
        pdl.wait_for_previous()
    row = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    x = tl.load(logits_ptr + row * stride_t + e, mask=valid, other=float("-inf")).to(tl.float32)
    ks = tl.arange(0, K_P2)
    if SOFTMAX_FIRST:
        p = tl.exp(x - tl.max(x, 0))
        p = p / tl.sum(p, 0)
        top, ids = _top_k(p, e, valid, K, K_P2, BLOCK_E)
        if RENORMALIZE:
            top = top / tl.sum(tl.where(ks < K, top, 0.0), 0)
    else:
        top, ids = _top_k(x, e, valid, K, K_P2, BLOCK_E)
        p = tl.where(ks < K, tl.exp(top - tl.max(top, 0)), 0.0)
        top = p / tl.sum(p, 0)
    _store(weights_ptr, ids_ptr, row, top, ids, K, K_P2)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr,
    stride_t,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_groups,
    group_size,
    topk_group,
    scaling,
    K: tl.constexpr,
    K_P2: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    FLAT: tl.constexpr,  # BLOCK_G * BLOCK_S
    SIGMOID: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        pdl.wait_for_previous()
    row = tl.program_id(0).to(tl.int64)
    groups = tl.arange(0, BLOCK_G)
    g = groups[:, None]
    j = tl.arange(0, BLOCK_S)[None, :]
    valid = (g < num_groups) & (j < group_size)
    e = g * group_size + j  # [BLOCK_G, BLOCK_S]: expert ids
    x = tl.load(logits_ptr + row * stride_t + e, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        p = tl.exp(x - tl.max(tl.max(x, 1), 0))
        scores = p / tl.sum(tl.sum(p, 1), 0)
    if HAS_BIAS:  # a group scores the sum of its two best corrected scores
        bias = tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, scores + bias, float("-inf"))
        first = tl.max(choice, 1)
        first_at = tl.min(tl.where(choice == first[:, None], j, BLOCK_S), 1)
        second = tl.max(tl.where(j == first_at[:, None], float("-inf"), choice), 1)
        group_score = first + second
    else:
        choice = tl.where(valid, scores, float("-inf"))
        group_score = tl.max(choice, 1)
    group_score = tl.where(groups < num_groups, group_score, float("-inf"))
    chosen = groups < 0  # all False
    for _ in range(topk_group):
        best = tl.max(group_score, 0)
        at = tl.min(tl.where(group_score == best, groups, BLOCK_G), 0)
        chosen = chosen | (groups == at)
        group_score = tl.where(groups == at, float("-inf"), group_score)
    candidates = tl.reshape(choice, [FLAT])
    experts = tl.reshape(e, [FLAT])
    _, ids = _top_k(candidates, experts, tl.reshape(chosen[:, None] & valid, [FLAT]), K, K_P2, FLAT)
    # The weights are the uncorrected scores of the chosen experts.
    scores = tl.reshape(scores, [FLAT])
    ks = tl.arange(0, K_P2)
    weights = tl.zeros([K_P2], tl.float32)
    for k in tl.static_range(K):
        at = tl.sum(tl.where(ks == k, ids, 0), 0)
        weights = tl.where(ks == k, tl.sum(tl.where(experts == at, scores, 0.0), 0), weights)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, 0) + 1e-20)
    _store(weights_ptr, ids_ptr, row, weights * scaling, ids, K, K_P2)


def _outputs(router_logits: torch.Tensor, top_k: int):
    """(logits with unit column stride, weights [T, K] fp32, ids [T, K] int32), both empty."""
    tokens, device = router_logits.shape[0], router_logits.device
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    return (
        router_logits,
        torch.empty(tokens, top_k, dtype=torch.float32, device=device),
        torch.empty(tokens, top_k, dtype=torch.int32, device=device),
    )


def _num_warps(block: int) -> int:
    return 1 if block <= 512 else 4


def _softmax_launch(router_logits, top_k: int, softmax_first: bool, renormalize: bool):
    if not fits(router_logits):
        if softmax_first:
            return reference.topk_softmax(router_logits, top_k, renormalize)
        return reference.topk_then_softmax(router_logits, top_k)
    router_logits, weights, ids = _outputs(router_logits, top_k)
    tokens, num_experts = router_logits.shape
    if tokens == 0:
        return weights, ids
    block = next_pow2(num_experts)
    use_pdl = pdl.enabled(router_logits.device)
    _topk_softmax_kernel[(tokens,)](
        router_logits,
        router_logits.stride(0),
        weights,
        ids,
        num_experts,
        K=top_k,
        K_P2=next_pow2(top_k),
        BLOCK_E=block,
        SOFTMAX_FIRST=softmax_first,
        RENORMALIZE=renormalize,
        USE_PDL=use_pdl,
        num_warps=_num_warps(block),
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return weights, ids


def fits(router_logits: torch.Tensor) -> bool:
    """Whether the kernels route these logits: switched on, and one program holds a token's
    logits (else the launchers route with the torch reference)."""
    return ENABLED and router_logits.shape[1] <= MAX_EXPERTS


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """As the torch reference `topk_softmax`: (weights [T, K] fp32, ids [T, K] int32)."""
    return _softmax_launch(router_logits, top_k, True, renormalize)


def topk_then_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As the torch reference `topk_then_softmax`."""
    return _softmax_launch(router_logits, top_k, False, False)


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
    """As the torch reference `grouped_topk`."""
    if not fits(router_logits):
        return reference.grouped_topk(
            router_logits, top_k, num_expert_group, topk_group, scoring_func,
            e_score_correction_bias, renormalize, routed_scaling_factor,
        )  # fmt: skip
    router_logits, weights, ids = _outputs(router_logits, top_k)
    tokens, num_experts = router_logits.shape
    if tokens == 0:
        return weights, ids
    group_size = num_experts // num_expert_group
    bias = e_score_correction_bias
    if bias is not None and bias.stride(0) != 1:
        bias = bias.contiguous()
    block_g, block_s = next_pow2(num_expert_group), next_pow2(group_size)
    use_pdl = pdl.enabled(router_logits.device)
    _grouped_topk_kernel[(tokens,)](
        router_logits,
        router_logits.stride(0),
        bias if bias is not None else router_logits,
        weights,
        ids,
        num_expert_group,
        group_size,
        topk_group,
        float(routed_scaling_factor),
        K=top_k,
        K_P2=next_pow2(top_k),
        BLOCK_G=block_g,
        BLOCK_S=block_s,
        FLAT=block_g * block_s,
        SIGMOID=scoring_func == "sigmoid",
        HAS_BIAS=bias is not None,
        RENORMALIZE=renormalize,
        USE_PDL=use_pdl,
        num_warps=_num_warps(block_g * block_s),
        **({"launch_pdl": True} if use_pdl else {}),
    )
    return weights, ids
