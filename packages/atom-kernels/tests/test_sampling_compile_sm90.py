"""The fused sampling kernels (``backends/triton/sampling.py``, ``sampling_block.py``) compile for
a real Hopper GPU (sm_90) without one, at Qwen3's vocabulary tiles, bf16 and fp32 logits, one
split a row and several. The GPU tests run them for real."""

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

from atom_kernels.backends.triton import sampling, sampling_block  # noqa: E402

KERNELS = {"gumbel": sampling._sample_kernel, "block": sampling_block._block_sample_kernel}
ALIGNED = {"logits_ptr", "token_ids_ptr", "logprobs_ptr", "part_f_ptr", "part_i_ptr"}


def _pointers(logits: str) -> dict[str, str]:
    return {
        "logits_ptr": f"*{logits}",
        "temperature_ptr": "*fp32",
        "seed_ptr": "*i32",
        "token_ids_ptr": "*i64",
        "logprobs_ptr": "*fp32",
        "part_f_ptr": "*fp32",
        "part_i_ptr": "*i32",
    }


@pytest.mark.parametrize("name", list(KERNELS))
@pytest.mark.parametrize("logits", ["bf16", "fp32"])
@pytest.mark.parametrize("single", [True, False])
@pytest.mark.parametrize("block_v,num_warps", [(2048, 8), (8192, 8)])
def test_sample_kernel_compiles_for_sm90(name, logits, single, block_v, num_warps):
    kernel = KERNELS[name]
    constexprs = dict(SINGLE=single, BLOCK_V=block_v)
    pointers = _pointers(logits)
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names
    }
    attrs = {
        (i,): [["tt.divisibility", 16]] for i, n in enumerate(kernel.arg_names) if n in ALIGNED
    }
    src = ASTSource(kernel, signature, constexprs, attrs)
    try:
        compiled = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=1)
        )
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    assert 0 < len(compiled.asm["cubin"])


def test_reduce_kernel_compiles_for_sm90():
    kernel = sampling._sample_reduce_kernel
    constexprs = dict(BLOCK_S=32)
    pointers = _pointers("bf16")
    signature = {
        n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in kernel.arg_names
    }
    src = ASTSource(kernel, signature, constexprs, {})
    try:
        compiled = triton.compile(
            src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, num_stages=1)
        )
    except FileNotFoundError as exc:  # pragma: no cover
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    assert 0 < len(compiled.asm["cubin"])
