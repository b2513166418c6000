"""The MoE routing kernels (``backends/triton/routing.py``) compile for a real Hopper GPU (sm_90)
without one, at the routed models' expert counts, with and without PDL (the interpreter tests
check their results; benchmarks/routing.py runs them on a GPU)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter child: nothing to compile
    pytest.skip("compiles for a GPU target; not under TRITON_INTERPRET", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the AOT entry points
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)

from atom_kernels.backends.triton import routing  # noqa: E402


def _compile(kernel, constexprs: dict, floats: tuple[str, ...] = (), num_warps: int = 1):
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name == "logits_ptr":
            signature[name] = "*bf16"
        elif name in ("weights_ptr", "bias_ptr"):
            signature[name] = "*fp32"
        elif name == "ids_ptr":
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name in floats else "i32"
    use_pdl = constexprs["USE_PDL"]
    try:
        compiled = triton.compile(
            ASTSource(kernel, signature, constexprs),
            target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=num_warps, **({"launch_pdl": True} if use_pdl else {})),
        )
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    assert 0 < len(compiled.asm["cubin"])
    return compiled.asm["ptx"]


# (experts, top_k, softmax first): Qwen3-235B, Mixtral, GPT-OSS (top-k then softmax)
@pytest.mark.parametrize(
    ("experts", "top_k", "first"), [(128, 8, True), (8, 2, True), (128, 4, False)]
)
@pytest.mark.parametrize("use_pdl", [False, True])
def test_topk_softmax_compiles_for_sm90(experts, top_k, first, use_pdl):
    block = triton.next_power_of_2(experts)
    ptx = _compile(
        routing._topk_softmax_kernel,
        dict(K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_E=block, SOFTMAX_FIRST=first,
             RENORMALIZE=first, USE_PDL=use_pdl),
        num_warps=routing._num_warps(block),
    )  # fmt: skip
    assert ("griddepcontrol.wait" in ptx) == use_pdl


# (groups, group size, top_k, sigmoid, bias): DeepSeek-V3, Kimi-K2 (384 in one group), GLM-4.5
@pytest.mark.parametrize(
    ("groups", "size", "top_k", "sigmoid", "bias"),
    [
        (8, 32, 8, True, True),
        (1, 384, 8, True, True),
        (1, 160, 8, True, True),
        (10, 16, 6, False, False),
    ],
)
def test_grouped_topk_compiles_for_sm90(groups, size, top_k, sigmoid, bias):
    block_g, block_s = triton.next_power_of_2(groups), triton.next_power_of_2(size)
    _compile(
        routing._grouped_topk_kernel,
        dict(K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK_G=block_g, BLOCK_S=block_s,
             FLAT=block_g * block_s, SIGMOID=sigmoid, HAS_BIAS=bias, RENORMALIZE=True,
             USE_PDL=True),
        floats=("scaling",),
        num_warps=routing._num_warps(block_g * block_s),
    )  # fmt: skip
