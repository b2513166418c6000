"""The prefill attention kernel compiles for a real Hopper GPU (sm_90), without one: Triton's
ahead-of-time compiler down to a cubin with its bundled ptxas, as test_moe_compile_sm90.py does
for the MoE kernels. The interpreter runs the numerics (test_triton_attention.py) but never sees
the GPU-only paths (warp specialization, register caps) nor the shared-memory budget of the tiles
``default_config`` picks; this compiles them on a CPU-only machine."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from dataclasses import replace

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter child: nothing to compile
    pytest.skip("compiles for a GPU target; not under TRITON_INTERPRET", allow_module_level=True)
triton = pytest.importorskip("triton")
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError:  # pragma: no cover - a Triton without the AOT entry points
    pytest.skip("this Triton has no ASTSource / GPUTarget", allow_module_level=True)

from atom_kernels.backends.triton import attention  # noqa: E402
from atom_kernels.backends.triton.attention_prefill import prefill_kernel  # noqa: E402

H100_SHARED_BYTES = 227 * 1024
DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
POINTERS = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "sinks_ptr")
INT_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr")
FLOATS = ("scale", "k_scale", "v_scale", "softcap")
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")


def _compile_prefill(config, dtype, head_dim, features=(), kv_type=None):
    """Compile prefill_kernel for sm_90 as attention.paged_attention would launch it with
    ``config``: 16-byte aligned pointers and strides (contiguous tensors), unit head-dim strides,
    pages of 16 tokens; ``kv_type`` the caches' Triton type (None: the query's)."""
    kv_type = kv_type or DTYPE[dtype]
    block_d = triton.next_power_of_2(max(head_dim, 16))
    constexprs = dict(
        HAS_WINDOW="window" in features,
        HAS_SINKS="sinks" in features,
        HAS_SOFTCAP="softcap" in features,
        K_SCALE_IS_PTR=False,
        V_SCALE_IS_PTR=False,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        EVEN_D=head_dim == block_d,
        HEAVY_FIRST=config.prefill_heavy_first,
        WARP_SPECIALIZE=attention.prefill_warp_specialize(config, dtype, False),
        BLOCK_SIZE=16,
        BLOCK_M=config.prefill_block_m,
        BLOCK_N=config.prefill_block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_d,
        **dict.fromkeys(UNIT_STRIDES, 1),
    )
    signature, attrs = {}, {}
    for i, name in enumerate(prefill_kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in POINTERS:
            cache = name.startswith(("k_cache", "v_cache"))
            signature[name] = "*" + (kv_type if cache else DTYPE[dtype])
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in ("k_scale_ptr", "v_scale_ptr"):
            signature[name] = "*fp32"
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        if name.endswith("_ptr") or (name.startswith("stride") and name != "stride_bt"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    options = dict(num_warps=config.prefill_num_warps, num_stages=config.prefill_num_stages)
    if config.prefill_maxnreg:
        options["maxnreg"] = config.prefill_maxnreg
    source = ASTSource(prefill_kernel, signature, constexprs, attrs)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


def _registers(kernel) -> int | None:
    """Registers a thread of the cubin uses, read with Triton's bundled cuobjdump (None: none)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [tool, "--dump-resource-usage", f.name], capture_output=True, text=True
        ).stdout
    match = re.search(r"REG:(\d+)", usage)
    return int(match.group(1)) if match else None


def _check(kernel, max_registers: int | None = None) -> None:
    assert 0 < len(kernel.asm["cubin"])
    assert kernel.metadata.shared <= H100_SHARED_BYTES
    if max_registers is not None and (registers := _registers(kernel)) is not None:
        assert registers <= max_registers


@pytest.mark.parametrize(
    ("dtype", "head_dim", "group", "features"),
    [
        (torch.bfloat16, 128, 4, ()),  # Llama-3-8B heads: the benchmark's case
        (torch.bfloat16, 128, 8, ("window", "sinks", "softcap")),
        (torch.bfloat16, 64, 4, ()),
        (torch.float16, 96, 1, ("window",)),  # a padded head dim (EVEN_D false)
        (torch.bfloat16, 256, 2, ("softcap",)),
        (torch.float32, 128, 4, ("sinks",)),
    ],
)
def test_prefill_default_config_compiles_for_sm90(dtype, head_dim, group, features):
    config = attention.default_config(head_dim, dtype, False, group)
    _check(_compile_prefill(config, dtype, head_dim, features))


def test_prefill_fp8_cache_compiles_for_sm90():
    config = attention.default_config(128, torch.bfloat16, False, 4)
    _check(_compile_prefill(config, torch.bfloat16, 128, ("sinks",), kv_type="fp8e4nv"))


@pytest.mark.parametrize(
    ("tiles", "warp_specialize", "maxnreg"),
    [
        ((128, 128, 8, 2), True, None),  # the default tiles with the warp-specialized loop
        ((128, 64, 8, 3), True, None),
        ((128, 32, 8, 3), False, 128),  # two programs an SM (default_config's NOTE)
        ((128, 32, 8, 4), False, 128),
    ],
)
def test_prefill_tuning_candidates_compile_for_sm90(tiles, warp_specialize, maxnreg):
    """The configs benchmarks/tune_prefill.py --compare times: each must compile, fit the
    shared memory, and keep to its register cap."""
    block_m, block_n, num_warps, num_stages = tiles
    config = replace(
        attention.default_config(128, torch.bfloat16, False, 4),
        prefill_block_m=block_m,
        prefill_block_n=block_n,
        prefill_num_warps=num_warps,
        prefill_num_stages=num_stages,
        prefill_warp_specialize=warp_specialize,
        prefill_maxnreg=maxnreg,
    )
    _check(_compile_prefill(config, torch.bfloat16, 128), max_registers=maxnreg)
