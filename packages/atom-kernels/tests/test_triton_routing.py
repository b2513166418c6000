"""The Triton MoE routing kernels (`backends/triton/routing.py`) against the torch reference, at
each routed model's expert count (interpreted on the CPU, compiled on a GPU)."""

import pytest
import torch

from atom_kernels.backends.torch import moe as reference
from atom_kernels.testing import assert_close, assert_equal


@pytest.fixture(autouse=True)
def _enabled(monkeypatch):
    """The kernels, whatever ATOM_TRITON_ROUTING says (on by default; `0`: the torch ops route)."""
    from atom_kernels.backends.triton import routing

    monkeypatch.setattr(routing, "ENABLED", True)


def _logits(tokens: int, experts: int, dtype, seed: int) -> torch.Tensor:
    """Distinct logits (a shuffled grid of multiples of 1/8, as test_moe.py's): no ties to break."""
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=gen) for _ in range(tokens)]
    return (torch.stack(rows).float() * 0.125 - experts / 16).to(dtype)


def _check(got, want):
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.int32
    assert_equal(got[1], want[1].to(got[1].device), name="ids, largest first")
    assert_close(got[0], want[0].to(got[0].device), atol=1e-6, rtol=2e-5, name="weights")


# (tokens, experts, top_k): Mixtral, Qwen3-MoE, GPT-OSS-20B, an odd count
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k"), [(3, 8, 2), (5, 128, 8), (2, 32, 4), (4, 5, 1)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax(triton_backend, tokens, experts, top_k, dtype, renormalize):
    from atom_kernels.backends.triton import routing

    logits = _logits(tokens, experts, dtype, seed=experts)
    got = routing.topk_softmax(logits.to(triton_backend.device), top_k, renormalize)
    _check(got, reference.topk_softmax(logits, top_k, renormalize))


@pytest.mark.parametrize(("tokens", "experts", "top_k"), [(3, 32, 4), (2, 128, 4), (1, 4, 4)])
def test_topk_then_softmax(triton_backend, tokens, experts, top_k):
    from atom_kernels.backends.triton import routing

    logits = _logits(tokens, experts, torch.bfloat16, seed=tokens)
    got = routing.topk_then_softmax(logits.to(triton_backend.device), top_k)
    _check(got, reference.topk_then_softmax(logits, top_k))


# (experts, groups, topk_group, top_k, scoring, bias, renormalize, scale): DeepSeek-V3 / R1,
# DeepSeek-V2 (softmax, no bias), Kimi-K2 (384 experts, one group), GLM-4.5 (160, one group),
# odd group counts
@pytest.mark.parametrize(
    ("experts", "groups", "topk_group", "top_k", "scoring", "bias", "renormalize", "scale"),
    [
        (256, 8, 4, 8, "sigmoid", True, True, 2.5),
        (160, 10, 3, 6, "softmax", False, False, 16.0),
        (384, 1, 1, 8, "sigmoid", True, True, 2.827),
        (160, 1, 1, 8, "sigmoid", True, True, 2.5),
        (24, 3, 2, 5, "softmax", True, True, 1.0),
    ],
)
def test_grouped_topk(triton_backend, experts, groups, topk_group, top_k, scoring, bias,
                      renormalize, scale):  # fmt: skip
    from atom_kernels.backends.triton import routing

    logits = _logits(4, experts, torch.float32, seed=groups)
    gen = torch.Generator().manual_seed(experts)
    correction = 0.05 * torch.randn(experts, generator=gen) if bias else None
    args = (top_k, groups, topk_group, scoring, correction, renormalize, scale)
    device = triton_backend.device
    got = routing.grouped_topk(
        logits.to(device), top_k, groups, topk_group, scoring,
        None if correction is None else correction.to(device), renormalize, scale,
    )  # fmt: skip
    _check(got, reference.grouped_topk(logits, *args))


def test_no_tokens_and_the_registry(triton_backend, monkeypatch):
    """Zero tokens give empty outputs; with ATOM_KERNEL_BACKEND=triton the public ops run these
    kernels (the registry's triton entries)."""
    import atom_kernels as ak
    from atom_kernels import registry
    from atom_kernels.backends.triton import routing

    device = triton_backend.device
    empty = torch.zeros(0, 16, device=device)
    weights, ids = routing.grouped_topk(empty, 2, 4, 2, "sigmoid", None, True, 1.0)
    assert weights.shape == ids.shape == (0, 2)
    routing.ENABLED = False  # switched off: the torch reference's results (restored after)
    try:
        logits = _logits(3, 16, torch.float32, seed=2).to(device)
        _check(routing.topk_softmax(logits, 2, False), reference.topk_softmax(logits, 2, False))
    finally:
        routing.ENABLED = True
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    if triton_backend.interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    registry._reset_for_tests()
    try:
        for name in ("topk_softmax", "topk_then_softmax", "grouped_topk"):
            assert ak.get_op(name, device) is triton_backend.custom_ops.ENTRIES[name]
        logits = _logits(2, 16, torch.float32, seed=1)
        _check(ak.topk_softmax(logits.to(device), 3, True), reference.topk_softmax(logits, 3, True))
        _check(
            ak.grouped_topk(logits.to(device), 3, num_expert_group=4, topk_group=2),
            reference.grouped_topk(logits, 3, 4, 2, "softmax", None, True, 1.0),
        )
    finally:
        registry._reset_for_tests()


def test_nan_and_infinite_logits_give_distinct_real_experts(triton_backend):
    """A NaN logit (every probability NaN after the softmax), a row of -inf, more picks than
    finite logits, an expert count that is not a power of two: the ids stay distinct experts
    of the row (an id past the last expert would index out of the experts, or into the padded
    lanes), and the rows without them route as the reference."""
    from atom_kernels.backends.triton import routing

    device = triton_backend.device
    logits = _logits(4, 6, torch.float32, seed=5)
    logits[1, 2] = float("nan")
    logits[2] = float("-inf")
    logits[3, 1:] = float("-inf")  # one finite logit, three picks
    for _weights, ids in (
        routing.topk_softmax(logits.to(device), 3, True),
        routing.topk_then_softmax(logits.to(device), 3),
        routing.grouped_topk(logits.to(device), 3, 2, 2, "sigmoid", None, True, 1.0),
    ):
        for row in ids.cpu().tolist():
            assert len(set(row)) == 3 and all(0 <= e < 6 for e in row), ids
        assert ids[3, 0] == 0  # the only finite logit first
    _check(
        routing.topk_softmax(logits[:1].to(device), 3, True),
        reference.topk_softmax(logits[:1], 3, True),
    )
