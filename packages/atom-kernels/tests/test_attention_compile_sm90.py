"""The prefill and decode attention kernels compile for a real Hopper GPU (sm_90), without one:
Triton's ahead-of-time compiler down to a cubin with its bundled ptxas, as
test_moe_compile_sm90.py does for the MoE kernels. The interpreter runs the numerics
(test_triton_attention.py) but never sees the GPU-only paths (warp specialization, register caps,
PDL) nor the shared-memory budget of the tiles ``default_config`` picks; this compiles them on a
CPU-only machine."""

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
from atom_kernels.backends.triton.attention_decode import decode_kernel  # noqa: E402
from atom_kernels.backends.triton.attention_prefill import prefill_kernel  # noqa: E402

H100_SHARED_BYTES = 227 * 1024
DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
POINTERS = ("q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "sinks_ptr")
INT_POINTERS = ("block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "count_ptr")
PARTIALS = ("m_part_ptr", "l_part_ptr", "acc_part_ptr")
FLOATS = ("scale", "k_scale", "v_scale", "softcap")
UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")


def _signature(kernel, constexprs, dtype, kv_type, aligned_ints=()):
    """Triton types of ``kernel``'s arguments as paged_attention passes them, and the 16-byte
    alignment attributes of its pointers and strides (contiguous tensors) and of the integers in
    ``aligned_ints`` (multiples of 16 at the launch: the JIT marks them so, and masks built from
    them keep vector loads)."""
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        if name in POINTERS:
            cache = name.startswith(("k_cache", "v_cache"))
            signature[name] = "*" + (kv_type if cache else DTYPE[dtype])
        elif name in INT_POINTERS:
            signature[name] = "*i32"
        elif name in ("k_scale_ptr", "v_scale_ptr") or name in PARTIALS:
            signature[name] = "*fp32"
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
        aligned = name.endswith("_ptr") or name in aligned_ints
        if aligned or (name.startswith("stride") and name != "stride_bt"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def _compile_decode(tile, dtype, head_dim, page_size, single_split, group=2, features=()):
    """Compile decode_kernel for sm_90 with a (KV tile, warps, stages) ``tile`` as
    paged_attention launches it (PDL on, as on sm_90); ``page_size`` the PAGE_SIZE constant."""
    block_n, num_warps, num_stages = tile
    block_d = triton.next_power_of_2(max(head_dim, 16))
    constexprs = dict(
        SINGLE_SPLIT=single_split,
        FUSED_REDUCE=False,
        HAS_WINDOW="window" in features,
        HAS_SINKS="sinks" in features,
        HAS_SOFTCAP="softcap" in features,
        K_SCALE_IS_PTR=False,
        V_SCALE_IS_PTR=False,
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        BLOCK_G=triton.next_power_of_2(max(group, 16)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_d,
        USE_PDL=True,
        PAGE_SIZE=page_size,
        **dict.fromkeys(UNIT_STRIDES, 1),
    )
    assert set(constexprs) - set(UNIT_STRIDES) <= set(decode_kernel.arg_names)
    # Qwen3 / Llama heads: 16 or 32 heads, head dims of 128, pages of 16 tokens.
    aligned = ("num_heads", "head_dim", "head_dim_v", "block_size")
    signature, attrs = _signature(decode_kernel, constexprs, dtype, DTYPE[dtype], aligned)
    source = ASTSource(decode_kernel, signature, constexprs, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages)
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas on this platform
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")


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
    signature, attrs = _signature(prefill_kernel, constexprs, dtype, kv_type)
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


def _default_decode_tiles():
    """The (KV tile, warps, stages) paged_attention takes for Qwen3-0.6B heads (bf16, D = 128,
    group 2) when splitting, unsplit, and from LARGE_BATCH_PROGRAMS_PER_SM programs an SM."""
    c = attention.default_config(128, torch.bfloat16, False, 2)
    return [c.decode_tile(0), c.decode_tile(attention.PROGRAMS_PER_SM), c.decode_tile(1e9)]


@pytest.mark.parametrize("page_size", [0, 16])
@pytest.mark.parametrize("regime", [0, 1, 2], ids=["split", "unsplit", "large"])
def test_decode_default_tiles_compile_for_sm90(regime, page_size):
    """The decode kernel at the default tiles, with the page size read at runtime or constant;
    the split regime with several splits (partials written), the others unsplit."""
    tile = _default_decode_tiles()[regime]
    _check(_compile_decode(tile, torch.bfloat16, 128, page_size, single_split=regime != 0))


def test_decode_features_compile_for_sm90():
    tile = _default_decode_tiles()[0]
    features = ("window", "sinks", "softcap")
    _check(_compile_decode(tile, torch.bfloat16, 128, 16, False, group=4, features=features))


def test_decode_sweep_tiles_compile_for_sm90():
    """The tiles benchmarks/decode_sweep.py times (compiled for the page size): each compiles
    and fits the shared memory of an H100."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "benchmarks" / "decode_sweep.py"
    if not path.exists():  # pragma: no cover - the package outside its repository
        pytest.skip("benchmarks/decode_sweep.py not found")
    spec = importlib.util.spec_from_file_location("decode_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    for tile in sweep.TILES:
        if tile not in _default_decode_tiles():
            _check(_compile_decode(tile, torch.bfloat16, 128, 16, single_split=True))


def test_decode_group16_runs_unsplit_on_128_token_tiles():
    """Qwen3-235B's 64 / 4 heads (group 16): from one program an SM the batch runs unsplit on
    128-token tiles (default_config's NOTE: 64 sequences on an H200's 132 SMs); group 4 keeps
    the split below PROGRAMS_PER_SM; the group-16 tile compiles for the GPU."""
    from atom_kernels.backends.triton.attention import choose_splits

    g16 = attention.default_config(128, torch.bfloat16, False, 16)
    g4 = attention.default_config(128, torch.bfloat16, False, 4)
    per_sm = 64 * 4 / 132
    assert g16.decode_tile(per_sm) == (128, 4, 2)
    assert g4.decode_tile(per_sm) == g4.decode_tile(0)  # still the split tiles
    assert choose_splits(64, 4, 4096, 132, 128, g16.unsplit_from()) == (1, 4096)
    assert choose_splits(64, 4, 4096, 132, 64, g4.unsplit_from())[0] > 1
    assert choose_splits(16, 4, 4096, 132, 128, g16.unsplit_from())[0] > 1  # 0.48 an SM
    _check(_compile_decode((128, 4, 2), torch.bfloat16, 128, 16, single_split=True, group=16))
