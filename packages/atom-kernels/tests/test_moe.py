"""MoE routing and fused_moe against independent per-token loops in fp64."""

from __future__ import annotations

import math

import pytest
import torch

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal, strided_copy

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) of fused_moe against fp64: GEMMs in the input dtype, the activation rounded to it.
MOE_TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def distinct_logits(num_tokens: int, num_experts: int, dtype, seed: int) -> torch.Tensor:
    """Logits with no ties in any dtype (a shuffled grid of multiples of 1/8), so that the
    selected experts are unambiguous."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(num_experts, generator=gen) for _ in range(num_tokens)]
    grid = torch.stack(rows).float() * 0.125 - num_experts / 16
    return grid.to(dtype)


def _softmax(values: list[float]) -> list[float]:
    m = max(values)
    exps = [math.exp(v - m) for v in values]
    return [e / sum(exps) for e in exps]


def _sigmoid(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def _top(values: list[float], k: int, among: list[int] | None = None) -> list[int]:
    candidates = range(len(values)) if among is None else among
    return sorted(candidates, key=lambda i: -values[i])[:k]


def _check_routing(weights, ids, expected: list[list[tuple[int, float]]], name: str) -> None:
    """Compare per token as {expert: weight} (the order of the k slots is free)."""
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert weights.shape == ids.shape == (len(expected), len(expected[0]))
    for t, row in enumerate(expected):
        assert sorted(ids[t].tolist()) == sorted(e for e, _ in row), f"{name} token {t}"
        got = dict(zip(ids[t].tolist(), weights[t].tolist(), strict=True))
        for expert, weight in row:
            assert math.isclose(got[expert], weight, rel_tol=1e-5, abs_tol=1e-6), (
                f"{name} token {t} expert {expert}: {got[expert]} != {weight}"
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (7, 64, 8), (33, 5, 1)]
)
def test_topk_softmax(num_tokens, num_experts, top_k, renormalize, dtype):
    logits = distinct_logits(num_tokens, num_experts, dtype, seed=num_experts)
    weights, ids = ak.topk_softmax(logits, top_k, renormalize)
    expected = []
    for row in logits.double().tolist():
        probs = _softmax(row)
        chosen = _top(probs, top_k)
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        expected.append([(e, probs[e] / total) for e in chosen])
    _check_routing(weights, ids, expected, "topk_softmax")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k"), [(1, 8, 2), (9, 32, 4), (3, 4, 4)])
def test_topk_then_softmax(num_tokens, num_experts, top_k, dtype):
    logits = distinct_logits(num_tokens, num_experts, dtype, seed=3)
    weights, ids = ak.topk_then_softmax(logits, top_k)
    expected = []
    for row in logits.double().tolist():
        chosen = _top(row, top_k)
        expected.append(list(zip(chosen, _softmax([row[e] for e in chosen]), strict=True)))
    _check_routing(weights, ids, expected, "topk_then_softmax")
    # The same experts and weights as softmax-then-top-k with renormalization (Mixtral's form).
    ref_weights, ref_ids = ak.topk_softmax(logits, top_k, renormalize=True)
    assert_equal(ids, ref_ids, name="ids")
    assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6, name="weights")


def _naive_grouped(row, bias, top_k, groups, topk_group, scoring, renormalize, scale):
    scores = _softmax(row) if scoring == "softmax" else [_sigmoid(v) for v in row]
    choice = scores if bias is None else [s + b for s, b in zip(scores, bias, strict=True)]
    size = len(row) // groups
    members = [list(range(g * size, (g + 1) * size)) for g in range(groups)]
    if bias is None:
        group_scores = [max(choice[e] for e in m) for m in members]
    else:
        group_scores = [sum(sorted((choice[e] for e in m), reverse=True)[:2]) for m in members]
    kept = [e for g in _top(group_scores, topk_group) for e in members[g]]
    chosen = _top(choice, top_k, among=kept)
    total = sum(scores[e] for e in chosen) if renormalize else 1.0
    return [(e, scores[e] / total * scale) for e in chosen]


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize(
    ("num_experts", "groups", "topk_group", "top_k", "renormalize", "scale"),
    [(16, 4, 2, 4, True, 2.5), (8, 1, 1, 2, False, 1.0), (64, 8, 3, 6, True, 1.0)],
)
def test_grouped_topk(
    num_experts, groups, topk_group, top_k, renormalize, scale, with_bias, scoring
):
    num_tokens = 11
    logits = distinct_logits(num_tokens, num_experts, torch.float32, seed=num_experts + groups)
    gen = torch.Generator().manual_seed(7)
    bias = 0.5 * torch.randn(num_experts, generator=gen) if with_bias else None
    weights, ids = ak.grouped_topk(
        logits,
        top_k,
        num_expert_group=groups,
        topk_group=topk_group,
        scoring_func=scoring,
        e_score_correction_bias=bias,
        renormalize=renormalize,
        routed_scaling_factor=scale,
    )
    bias_list = None if bias is None else bias.double().tolist()
    expected = [
        _naive_grouped(row, bias_list, top_k, groups, topk_group, scoring, renormalize, scale)
        for row in logits.double().tolist()
    ]
    _check_routing(weights, ids, expected, "grouped_topk")
    # The chosen experts come from at most topk_group groups.
    for row in (ids // (num_experts // groups)).tolist():
        assert len(set(row)) <= topk_group


def test_grouped_topk_with_one_group_is_plain_topk():
    logits = distinct_logits(6, 16, torch.float32, seed=1)
    weights, ids = ak.grouped_topk(logits, 3, num_expert_group=1, topk_group=1, renormalize=True)
    ref_weights, ref_ids = ak.topk_softmax(logits, 3, renormalize=True)
    assert_equal(ids, ref_ids, name="ids")
    assert_close(weights, ref_weights, atol=1e-6, rtol=1e-6, name="weights")


# -- fused_moe ---------------------------------------------------------------------------------


def _naive_moe(hidden, w13, w2, weights, ids, activation, b13, b2, interleaved, alpha, limit):
    """One token, one selected expert at a time, in fp64."""
    num_tokens, hidden_size = hidden.shape
    size = w2.shape[2]
    out = torch.zeros(num_tokens, hidden_size, dtype=torch.float64)
    for t in range(num_tokens):
        x = hidden[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e < 0:  # a slot this call does not compute
                continue
            gate_up = w13[e].double() @ x
            if b13 is not None:
                gate_up = gate_up + b13[e].double()
            if interleaved:
                g, u = gate_up[0::2], gate_up[1::2]
            else:
                g, u = gate_up[:size], gate_up[size:]
            if activation == "silu":
                act = g / (1 + torch.exp(-g)) * u
            elif activation == "gelu":
                act = 0.5 * g * (1 + torch.erf(g / math.sqrt(2))) * u
            else:
                g = torch.minimum(g, torch.tensor(limit, dtype=torch.float64))
                u = torch.clamp(u, -limit, limit)
                act = (u + 1) * g / (1 + torch.exp(-alpha * g))
            y = w2[e].double() @ act
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(weights[t, k]) * y
    return out


def _moe_inputs(num_tokens, num_experts, top_k, hidden_size, size, dtype, seed, bias, gate_scale):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    w13 = torch.randn(num_experts, 2 * size, hidden_size, generator=gen) / hidden_size**0.5
    w2 = torch.randn(num_experts, hidden_size, size, generator=gen) / size**0.5
    b13 = 0.5 * torch.randn(num_experts, 2 * size, generator=gen) if bias else None
    b2 = 0.5 * torch.randn(num_experts, hidden_size, generator=gen) if bias else None
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = ak.topk_softmax(logits, top_k, renormalize=False)
    cast = [t if t is None else t.to(dtype) for t in (hidden, gate_scale * w13, w2, b13, b2)]
    return (*cast, weights, ids)


CASES = {
    # (T, E, K, H, I)
    "decode-1-token": (1, 8, 2, 64, 32),
    "odd-shapes": (7, 5, 3, 45, 23),
    "most-experts-idle": (3, 64, 2, 32, 16),
    "prefill": (67, 16, 4, 48, 40),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    ("activation", "bias", "interleaved"),
    [
        ("silu", False, False),
        ("gelu", True, False),
        ("swiglu_oai", True, True),
        ("swiglu_oai", False, False),
    ],
)
def test_fused_moe_matches_per_token_loop(case, dtype, activation, bias, interleaved):
    num_tokens, num_experts, top_k, hidden_size, size = CASES[case]
    # swiglu_oai: scale the gate/up projections up so that the +-7 clamps are hit.
    gate_scale = 6.0 if activation == "swiglu_oai" else 1.0
    hidden, w13, w2, b13, b2, weights, ids = _moe_inputs(
        num_tokens, num_experts, top_k, hidden_size, size, dtype, len(case), bias, gate_scale
    )
    out = ak.fused_moe(
        hidden,
        w13,
        w2,
        weights,
        ids,
        activation=activation,
        w13_bias=b13,
        w2_bias=b2,
        gate_up_interleaved=interleaved,
    )
    assert out.shape == (num_tokens, hidden_size) and out.dtype == dtype
    expected = _naive_moe(
        hidden, w13, w2, weights, ids, activation, b13, b2, interleaved, 1.702, 7.0
    )
    atol, rtol = MOE_TOLERANCES[dtype]
    if dtype != torch.float32:  # the rounding of intermediates scales with their size
        atol *= max(1.0, expected.abs().max().item())
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"fused_moe {case} {activation}")


def test_fused_moe_clamps_are_hit():
    """The swiglu_oai case above really exercises both clamps."""
    hidden, w13, _, b13, _, _, _ = _moe_inputs(67, 16, 4, 48, 40, torch.float32, 7, True, 6.0)
    gate_up = torch.einsum("th,eih->tei", hidden, w13) + b13
    assert (gate_up[..., 0::2] > 7).any() and (gate_up[..., 1::2] < -7).any()


def test_fused_moe_strided_int64_and_skewed_routing():
    """Non-contiguous inputs, int64 ids, every token on the same two of 16 experts."""
    hidden, w13, w2, _, _, weights, _ = _moe_inputs(9, 16, 2, 32, 24, torch.float32, 1, False, 1.0)
    ids = torch.tensor([[3, 11]] * 9, dtype=torch.int64)
    out = ak.fused_moe(
        strided_copy(hidden),
        w13.transpose(1, 2).contiguous().transpose(1, 2),
        w2,
        strided_copy(weights),
        ids,
    )
    expected = _naive_moe(hidden, w13, w2, weights, ids, "silu", None, None, False, 0.0, 0.0)
    assert_close(out, expected, atol=2e-5, rtol=2e-5, name="fused_moe strided")


def test_fused_moe_interleaved_equals_split_layout():
    hidden, w13, w2, b13, b2, weights, ids = _moe_inputs(5, 4, 2, 16, 8, torch.float32, 2, True, 4)

    def interleave(t):  # [E, 2I, ...] as [gate | up] -> rows g0, u0, g1, u1, ...
        return torch.stack(t.chunk(2, dim=1), dim=2).flatten(1, 2)

    args = dict(activation="swiglu_oai", w2_bias=b2)
    split = ak.fused_moe(hidden, w13, w2, weights, ids, w13_bias=b13, **args)
    interleaved = ak.fused_moe(
        hidden,
        interleave(w13),
        w2,
        weights,
        ids,
        w13_bias=interleave(b13),
        gate_up_interleaved=True,
        **args,
    )
    assert_equal(interleaved, split, name="interleaved vs split")


def _skip_slots(ids: torch.Tensor, seed: int) -> torch.Tensor:
    """ids with about half the slots -1 (another rank's experts), token 0's all of them."""
    gen = torch.Generator().manual_seed(seed)
    skipped = torch.rand(ids.shape, generator=gen) < 0.5
    skipped[0] = True
    return ids.masked_fill(skipped, -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_moe_skips_minus_one_slots(case, dtype):
    """A -1 slot adds nothing: the per-token loop over the other slots, biases included; a token
    whose slots are all -1 gets an exact zero row."""
    num_tokens, num_experts, top_k, hidden_size, size = CASES[case]
    hidden, w13, w2, b13, b2, weights, ids = _moe_inputs(
        num_tokens, num_experts, top_k, hidden_size, size, dtype, 3, True, 1.0
    )
    ids = _skip_slots(ids, seed=len(case))
    out = ak.fused_moe(hidden, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2)
    expected = _naive_moe(hidden, w13, w2, weights, ids, "silu", b13, b2, False, 0.0, 0.0)
    atol, rtol = MOE_TOLERANCES[dtype]
    if dtype != torch.float32:
        atol *= max(1.0, expected.abs().max().item())
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"fused_moe {case} with -1 slots")
    assert_equal(out[0], torch.zeros_like(out[0]), name="token with every slot -1")


def test_bad_arguments():
    hidden, w13, w2, _, _, weights, ids = _moe_inputs(3, 4, 2, 16, 8, torch.float32, 0, False, 1.0)
    with pytest.raises(ValueError, match=r"fused_moe: w2 has shape \(4, 16, 7\), expected"):
        ak.fused_moe(hidden, w13, w2[..., :7], weights, ids)
    with pytest.raises(ValueError, match="fused_moe: activation must be one of"):
        ak.fused_moe(hidden, w13, w2, weights, ids, activation="relu")
    with pytest.raises(ValueError, match="fused_moe: topk_ids has dtype torch.float32"):
        ak.fused_moe(hidden, w13, w2, weights, weights)
    with pytest.raises(ValueError, match="fused_moe: w13 has dtype torch.bfloat16"):
        ak.fused_moe(hidden, w13.bfloat16(), w2, weights, ids)
    with pytest.raises(ValueError, match=r"fused_moe: w13_bias has shape \(4, 8\), expected"):
        ak.fused_moe(hidden, w13, w2, weights, ids, w13_bias=torch.zeros(4, 8))
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"topk_softmax: top_k must be an int in 1\.\.8"):
        ak.topk_softmax(logits, 9, True)
    with pytest.raises(ValueError, match="do not split into num_expert_group=3"):
        ak.grouped_topk(logits, 2, num_expert_group=3, topk_group=1)
    with pytest.raises(ValueError, match="top_k=5 is more than the 4 experts"):
        ak.grouped_topk(logits, 5, num_expert_group=4, topk_group=2)
    with pytest.raises(ValueError, match="scoring_func must be one of"):
        ak.grouped_topk(logits, 2, num_expert_group=2, topk_group=1, scoring_func="relu")
    with pytest.raises(ValueError, match=r"e_score_correction_bias has shape \(4,\)"):
        ak.grouped_topk(
            logits, 2, num_expert_group=2, topk_group=1, e_score_correction_bias=torch.zeros(4)
        )


def _wna16_experts(num_experts, hidden, inter, bits, groups, seed):
    """Random packed experts (int32 words of random bits: every value of 0 .. 2**bits - 1
    occurs), scales [E, N, groups] and integer zeros, fp32."""
    gen = torch.Generator().manual_seed(seed)
    per_int = 32 // bits

    def weight(rows, k):
        words = torch.randint(-(2**31), 2**31, (num_experts, rows, k // per_int), generator=gen)
        scales = (torch.rand(num_experts, rows, groups, generator=gen) + 0.5) / (k**0.5 * 2**bits)
        zeros = torch.randint(0, 2**bits, (num_experts, rows, groups), generator=gen).float()
        return words.to(torch.int32), scales, zeros

    return weight(2 * inter, hidden), weight(hidden, inter)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("asym", [False, True])
def test_fused_moe_wna16_is_the_dequantized_model(bits, asym):
    """quant="wna16" computes the unquantized fused_moe of ``dequantize_wna16``'s experts (-1
    slots included)."""
    (q13, s13, z13), (q2, s2, z2) = _wna16_experts(4, 64, 32, bits, 2, seed=bits)
    if not asym:
        z13 = z2 = None
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 64, generator=gen)
    weights, ids = ak.topk_softmax(torch.randn(5, 4, generator=gen), 2, True)
    ids[1, 0] = -1
    out = ak.fused_moe(hidden, q13, q2, weights, ids, quant="wna16", w13_scale=s13,
                       w2_scale=s2, w13_zeros=z13, w2_zeros=z2)  # fmt: skip
    w13 = torch.stack([ak.dequantize_wna16(q13[e], s13[e], None if z13 is None else z13[e], None,
                                           bits) for e in range(4)])  # fmt: skip
    w2 = torch.stack([ak.dequantize_wna16(q2[e], s2[e], None if z2 is None else z2[e], None,
                                          bits) for e in range(4)])  # fmt: skip
    expected = ak.fused_moe(hidden, w13, w2, weights, ids)
    assert_close(out, expected, atol=1e-6, rtol=1e-6, name=f"wna16 int{bits} asym={asym}")


def test_bad_wna16_arguments():
    (q13, s13, z13), (q2, s2, z2) = _wna16_experts(4, 64, 32, 4, 2, seed=0)
    hidden = torch.randn(3, 64)
    weights, ids = ak.topk_softmax(torch.randn(3, 4), 2, True)
    quant = dict(quant="wna16", w13_scale=s13, w2_scale=s2)

    def call(w13=q13, w2=q2, **kwargs):
        return ak.fused_moe(hidden, w13, w2, weights, ids, **{**quant, **kwargs})

    with pytest.raises(ValueError, match=r"w13 has shape \(4, 64, 7\); its last dim must be H"):
        call(w13=q13[..., :7])
    with pytest.raises(ValueError, match="w13 has dtype torch.uint8, expected one of int32"):
        call(w13=q13.to(torch.uint8))
    with pytest.raises(ValueError, match=r"w2 has shape \(4, 64, 8\), expected \(4, 64, 4"):
        call(w2=torch.cat([q2, q2], dim=-1))
    with pytest.raises(ValueError, match="bits must be one of"):  # H * 2 / 32 words: 2 bits
        call(w13=q13[..., :4])
    with pytest.raises(ValueError, match=r"w13 has shape \(4, 63, 8\); its dim 1 \(2I\) must be"):
        call(w13=q13[:, :63])
    with pytest.raises(ValueError, match="w13_scale has 3 groups along K = 64"):
        call(w13_scale=torch.ones(4, 64, 3))
    with pytest.raises(ValueError, match=r"w13_zeros has shape \(4, 64, 1\), expected \(4, 64, 2"):
        call(w13_zeros=z13[..., :1])
    with pytest.raises(ValueError, match="w2_zeros has dtype torch.float16, expected one of"):
        call(w2_zeros=z2.half())
    with pytest.raises(ValueError, match="quant='wna16' needs w2_scale"):
        call(w2_scale=None)
    with pytest.raises(ValueError, match="block_size is only for quant='fp8_block'"):
        call(block_size=(128, 128))
    with pytest.raises(ValueError, match="w13_zeros is only for quant='wna16', got quant=None"):
        ak.fused_moe(hidden, q13, q2, weights, ids, w13_zeros=z13)
    with pytest.raises(ValueError, match="w2_zeros is only for quant='wna16', got quant='mxfp4'"):
        call(quant="mxfp4", w2_zeros=z2)
