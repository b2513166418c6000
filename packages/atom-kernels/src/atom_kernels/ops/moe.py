"""Mixture of experts: routing (which experts each token visits, with what weight) and the fused
expert computation.

T = tokens, E = experts, K = experts per token (top-k), H = hidden size, I = expert intermediate
size. Routing ops return ``(topk_weights [T, K] fp32, topk_ids [T, K] int32)``; ``fused_moe``
consumes them.
"""

from __future__ import annotations

import torch

from atom_kernels.ops._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_dim,
    check_same_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)
from atom_kernels.ops.int_quant import check_wna16_weight
from atom_kernels.ops.quant import (
    FP8_DTYPE,
    MXFP4_BLOCK,
    check_block_scale,
    check_block_size,
)
from atom_kernels.registry import get_op

ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
QUANT_METHODS = ("fp8_block", "fp8_channel", "mxfp4", "wna16")
SCORING_FUNCS = ("softmax", "sigmoid")


def _check_logits(op: str, router_logits: torch.Tensor, top_k: int) -> int:
    check_tensor(op, "router_logits", router_logits, ndim=2, dtypes=FLOAT_DTYPES)
    num_experts = router_logits.shape[1]
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ValueError(f"{op}: top_k must be an int in 1..{num_experts} (experts), got {top_k!r}")
    return num_experts


def topk_softmax(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then the top-k (Qwen3-MoE, Mixtral; HF semantics).

    router_logits: [T, E] fp32/bf16/fp16. Returns (topk_weights [T, K] fp32, topk_ids [T, K]
    int32), largest first. ``renormalize``: divide the k weights by their sum (Qwen3-MoE's
    ``norm_topk_prob``; always on for Mixtral). With renormalize this equals ``topk_then_softmax``.
    """
    _check_logits("topk_softmax", router_logits, top_k)
    return get_op("topk_softmax", router_logits.device)(router_logits, top_k, bool(renormalize))


def topk_then_softmax(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over the logits, then softmax over the k selected (GPT-OSS's router; its bias is
    already in the logits).

    router_logits: [T, E]. Returns (topk_weights [T, K] fp32, topk_ids [T, K] int32).
    """
    _check_logits("topk_then_softmax", router_logits, top_k)
    return get_op("topk_then_softmax", router_logits.device)(router_logits, top_k)


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    num_expert_group: int,
    topk_group: int,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-limited top-k (DeepSeek-V3, GLM-4-MoE).

    scores = softmax or sigmoid of router_logits [T, E] (fp32). Experts form ``num_expert_group``
    equal groups; with ``e_score_correction_bias`` [E] a group's score is the sum of its two best
    corrected scores (scores + bias), without it its best score. Only experts of the
    ``topk_group`` best groups compete for the top-k (ranked by corrected scores); the weights
    are their uncorrected scores, divided by their sum (+1e-20) when ``renormalize``, then times
    ``routed_scaling_factor``. Returns (topk_weights [T, K] fp32, topk_ids [T, K] int32).
    """
    op = "grouped_topk"
    num_experts = _check_logits(op, router_logits, top_k)
    for name, value in (("num_expert_group", num_expert_group), ("topk_group", topk_group)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{op}: {name} must be a positive int, got {value!r}")
    if num_experts % num_expert_group:
        raise ValueError(
            f"{op}: {num_experts} experts do not split into num_expert_group={num_expert_group} "
            "equal groups"
        )
    if topk_group > num_expert_group:
        raise ValueError(
            f"{op}: topk_group={topk_group} is more than num_expert_group={num_expert_group}"
        )
    group_size = num_experts // num_expert_group
    if top_k > topk_group * group_size:
        raise ValueError(
            f"{op}: top_k={top_k} is more than the {topk_group * group_size} experts of the "
            f"topk_group={topk_group} selected groups"
        )
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"{op}: scoring_func must be one of {SCORING_FUNCS}, got {scoring_func!r}")
    if e_score_correction_bias is not None:
        bias = e_score_correction_bias
        check_tensor(op, "e_score_correction_bias", bias, ndim=1, dtypes=FLOAT_DTYPES)
        check_shape(op, "e_score_correction_bias", bias, (num_experts,), "(one per expert)")
        check_same_device(op, "router_logits", router_logits, e_score_correction_bias=bias)
        if group_size < 2:
            raise ValueError(f"{op}: scoring groups by their top-2 needs >= 2 experts per group")
    if not isinstance(routed_scaling_factor, (int, float)) or not routed_scaling_factor > 0:
        raise ValueError(
            f"{op}: routed_scaling_factor must be a positive number, got {routed_scaling_factor!r}"
        )
    return get_op(op, router_logits.device)(
        router_logits,
        top_k,
        num_expert_group,
        topk_group,
        scoring_func,
        e_score_correction_bias,
        bool(renormalize),
        float(routed_scaling_factor),
    )


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    gate_up_interleaved: bool = False,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
    quant: str | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_size: tuple[int, int] | list[int] | None = None,
    w13_zeros: torch.Tensor | None = None,
    w2_zeros: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden_states[t]).

    expert_e(x) = w2[e] @ act(w13[e] @ x + w13_bias[e]) + w2_bias[e].

    hidden_states: [T, H]; w13: [E, 2I, H] (gate and up projections, stacked); w2: [E, H, I],
    biases [E, 2I] and [E, H] or None, all in hidden_states' dtype; topk_weights: [T, K] (any
    float dtype); topk_ids: [T, K] int32/int64 in [0, E), or -1: a slot this call does not
    compute (expert parallelism: an expert another rank owns). A -1 slot adds nothing to its
    token's row (its weight is ignored), gets no GEMM rows and reads no expert weights; a token
    whose slots are all -1 gets a zero row. ``gate_up_interleaved``: the 2I rows of w13 alternate
    gate, up (GPT-OSS's layout) instead of being [gate | up]. ``activation``:

    - "silu": silu(gate) * up;  "gelu": gelu(gate) * up (erf);
    - "swiglu_oai" (GPT-OSS): g = min(gate, limit), u = clamp(up, -limit, limit),
      (u + 1) * g * sigmoid(alpha * g).

    Quantized experts (``quant``; biases stay in hidden_states' dtype):

    - "fp8_block": w13 float8_e4m3fn [E, 2I, H] with w13_scale float32
      [E, ceil(2I / bn), ceil(H / bk)], w2 float8_e4m3fn [E, H, I] with w2_scale
      [E, ceil(H / bn), ceil(I / bk)]; block_size (bn, bk).
    - "fp8_channel": the same weights, scales per output row: w13_scale [E, 2I], w2_scale [E, H].
    - "mxfp4": w13 uint8 [E, 2I, H / 2] (two e2m1 values a byte along H, low nibble first) with
      w13_scale uint8 e8m0 [E, 2I, H / 32]; w2 uint8 [E, H, I / 2] with w2_scale [E, H, I / 32].
    - "wna16": 4- or 8-bit integer weights packed in int32 along the input dim, per expert the
      layout of ``atom_kernels.wna16_linear`` (``atom_kernels.ops.int_quant``): w13 int32
      [E, 2I, H * bits / 32] with w13_scale [E, 2I, G13] in hidden_states' dtype and w13_zeros
      (None: symmetric) of the same shape; w2 int32 [E, H, I * bits / 32] with w2_scale and
      w2_zeros [E, H, G2]. bits (4 or 8) is read from w13's shape and H; group sizes from the
      scales' last dims (H / G13, I / G2).

    The torch backend computes exactly the dequantized model (each routed expert's weights
    dequantized in float32 and cast to hidden_states' dtype); the Triton kernels dequantize the
    weight tiles in their K loops (weight-only: activations stay in hidden_states' dtype).

    Returns [T, H] in hidden_states' dtype (activation and weighted sum in fp32).
    """
    op = "fused_moe"
    check_tensor(op, "hidden_states", hidden_states, ndim=2, dtypes=FLOAT_DTYPES)
    num_tokens, hidden_size = hidden_states.shape
    num_experts = w13.shape[0] if isinstance(w13, torch.Tensor) and w13.dim() else 0
    if quant != "wna16":
        for name, value in (("w13_zeros", w13_zeros), ("w2_zeros", w2_zeros)):
            if value is not None:
                raise ValueError(f"{op}: {name} is only for quant='wna16', got quant={quant!r}")
    if quant is None:
        for name, value in (
            ("w13_scale", w13_scale),
            ("w2_scale", w2_scale),
            ("block_size", block_size),
        ):
            if value is not None:
                raise ValueError(
                    f"{op}: {name} is given but quant is None; pass quant= one of {QUANT_METHODS}"
                )
        check_tensor(op, "w13", w13, ndim=3, dtypes=FLOAT_DTYPES)
        check_tensor(op, "w2", w2, ndim=3, dtypes=FLOAT_DTYPES)
        check_same_dtype(op, "hidden_states", hidden_states, w13=w13, w2=w2)
        check_dim(op, "w13", w13, 2, hidden_size, "(its last dim is the hidden size)")
        if w13.shape[1] % 2:
            raise ValueError(f"{op}: w13 has shape {tuple(w13.shape)}; its dim 1 (2I) must be even")
        intermediate_size = w13.shape[1] // 2
        check_shape(op, "w2", w2, (num_experts, hidden_size, intermediate_size), "([E, H, I])")
    else:
        intermediate_size = _check_quant_experts(
            op, quant, hidden_size, w13, w2, w13_scale, w2_scale, block_size, w13_zeros, w2_zeros
        )
        if quant == "wna16":  # the scales (and zeros) are in the activations' dtype
            check_same_dtype(
                op, "hidden_states", hidden_states, w13_scale=w13_scale, w2_scale=w2_scale
            )
    check_tensor(op, "topk_weights", topk_weights, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor(op, "topk_ids", topk_ids, ndim=2, dtypes=INDEX_DTYPES)
    check_dim(op, "topk_ids", topk_ids, 0, num_tokens, "(one row per token)")
    check_shape(op, "topk_weights", topk_weights, tuple(topk_ids.shape), "(to match topk_ids)")
    for name, bias, shape in (
        ("w13_bias", w13_bias, (num_experts, 2 * intermediate_size)),
        ("w2_bias", w2_bias, (num_experts, hidden_size)),
    ):
        if bias is not None:
            check_tensor(op, name, bias, ndim=2, dtypes=FLOAT_DTYPES)
            check_shape(op, name, bias, shape, "")
            check_same_dtype(op, "hidden_states", hidden_states, **{name: bias})
    check_same_device(
        op,
        "hidden_states",
        hidden_states,
        w13=w13,
        w2=w2,
        topk_weights=topk_weights,
        topk_ids=topk_ids,
        w13_bias=w13_bias,
        w2_bias=w2_bias,
        w13_scale=w13_scale,
        w2_scale=w2_scale,
        w13_zeros=w13_zeros,
        w2_zeros=w2_zeros,
    )
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    # Quantized calls only pass the quantization keywords, so a backend without them still
    # serves the unquantized op.
    extra = {}
    if quant is not None:
        extra = dict(
            quant=quant,
            w13_scale=w13_scale,
            w2_scale=w2_scale,
            block_size=None if block_size is None else tuple(block_size),
        )
        if quant == "wna16":
            extra.update(w13_zeros=w13_zeros, w2_zeros=w2_zeros)
    return get_op(op, hidden_states.device)(
        hidden_states,
        w13,
        w2,
        topk_weights,
        topk_ids,
        activation,
        w13_bias,
        w2_bias,
        bool(gate_up_interleaved),
        float(swiglu_alpha),
        float(swiglu_limit),
        **extra,
    )


def _check_quant_experts(
    op: str,
    quant: object,
    hidden_size: int,
    w13: object,
    w2: object,
    w13_scale: object,
    w2_scale: object,
    block_size: object,
    w13_zeros: object = None,
    w2_zeros: object = None,
) -> int:
    """The quantized expert weights and their scales (see ``fused_moe``); returns I."""
    if quant not in QUANT_METHODS:
        raise ValueError(f"{op}: quant must be None or one of {QUANT_METHODS}, got {quant!r}")
    if quant != "fp8_block" and block_size is not None:
        raise ValueError(
            f"{op}: block_size is only for quant='fp8_block', got {block_size!r} "
            f"with quant={quant!r}"
        )
    for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
        if scale is None:
            raise ValueError(f"{op}: quant={quant!r} needs {name}")
    if quant == "wna16":
        return _check_wna16_experts(
            op, hidden_size, w13, w2, w13_scale, w2_scale, w13_zeros, w2_zeros
        )
    weight_dtypes = (torch.uint8,) if quant == "mxfp4" else (FP8_DTYPE,)
    check_tensor(op, "w13", w13, ndim=3, dtypes=weight_dtypes)
    check_tensor(op, "w2", w2, ndim=3, dtypes=weight_dtypes)
    num_experts = w13.shape[0]
    if w13.shape[1] % 2:
        raise ValueError(f"{op}: w13 has shape {tuple(w13.shape)}; its dim 1 (2I) must be even")
    inter_size = w13.shape[1] // 2
    if quant == "mxfp4":
        for name, size in (("hidden size H", hidden_size), ("intermediate size I", inter_size)):
            if size % MXFP4_BLOCK:
                raise ValueError(
                    f"{op}: quant='mxfp4' needs the {name} to be a multiple of "
                    f"{MXFP4_BLOCK}, got {size}"
                )
        check_shape(
            op,
            "w13",
            w13,
            (num_experts, 2 * inter_size, hidden_size // 2),
            "([E, 2I, H / 2]: two e2m1 values a byte along the hidden size)",
        )
        check_shape(
            op,
            "w2",
            w2,
            (num_experts, hidden_size, inter_size // 2),
            "([E, H, I / 2]: two e2m1 values a byte along the intermediate size)",
        )
        for name, scale, weight in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
            check_tensor(op, name, scale, ndim=3, dtypes=(torch.uint8,))
            grid = (*weight.shape[:2], weight.shape[2] * 2 // MXFP4_BLOCK)
            check_shape(
                op,
                name,
                scale,
                grid,
                f"(one e8m0 scale per {MXFP4_BLOCK} values of "
                f"the unpacked weight {tuple(weight.shape[:2])} x {grid[2] * 32})",
            )
        return inter_size
    check_dim(op, "w13", w13, 2, hidden_size, "(its last dim is the hidden size)")
    check_shape(op, "w2", w2, (num_experts, hidden_size, inter_size), "([E, H, I])")
    if quant == "fp8_block":
        block = check_block_size(op, block_size)
        check_block_scale(op, "w13_scale", w13_scale, w13, block, "w13")
        check_block_scale(op, "w2_scale", w2_scale, w2, block, "w2")
    else:  # fp8_channel
        for name, scale, weight in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
            check_tensor(op, name, scale, ndim=2, dtypes=(torch.float32,))
            check_shape(op, name, scale, tuple(weight.shape[:2]), "(one scale per output row)")
    return inter_size


def _check_wna16_experts(
    op: str,
    hidden_size: int,
    w13: object,
    w2: object,
    w13_scale: object,
    w2_scale: object,
    w13_zeros: object,
    w2_zeros: object,
) -> int:
    """quant="wna16" experts (see ``fused_moe``); returns I."""
    check_tensor(op, "w13", w13, ndim=3, dtypes=(torch.int32,))
    check_tensor(op, "w2", w2, ndim=3, dtypes=(torch.int32,))
    if hidden_size == 0 or (32 * w13.shape[2]) % hidden_size:
        raise ValueError(
            f"{op}: w13 has shape {tuple(w13.shape)}; its last dim must be H * bits / 32"
        )
    bits = 32 * w13.shape[2] // hidden_size
    num_experts, two_i = w13.shape[0], w13.shape[1]
    if two_i % 2:
        raise ValueError(f"{op}: w13 has shape {tuple(w13.shape)}; its dim 1 (2I) must be even")
    inter_size = two_i // 2
    lead = (num_experts,)
    names13, names2 = ("w13", "w13_scale", "w13_zeros"), ("w2", "w2_scale", "w2_zeros")
    check_wna16_weight(op, w13, w13_scale, w13_zeros, None, bits, hidden_size, names13, lead)
    check_wna16_weight(op, w2, w2_scale, w2_zeros, None, bits, inter_size, names2, lead)
    return inter_size
