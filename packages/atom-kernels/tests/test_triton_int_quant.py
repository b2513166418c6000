"""Triton integer-quantized ops against the torch reference: WNA16 dequantization bit for bit, the
WNA16 GEMM (one row, few rows, prefill tiles; split-K or not; every zeros / g_idx / group
variant) within the dtype's rounding, int8 activation quantization and the W8A8 GEMM bit for bit.
Random int32 words are valid packed weights (every bit pattern is a set of unsigned values)."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.backends.torch import int_quant as reference
from atom_kernels.ops.int_quant_frag import frag_fits, frag_shape, wna16_from_frag, wna16_to_frag
from atom_kernels.testing import assert_close, assert_equal, strided_copy

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) of the WNA16 GEMM against the reference on outputs ~N(0, 1): the same weight (the
# one-row kernel keeps it in fp32, the reference rounds it to x's dtype), fp32 sums in another
# order, the output rounded to its dtype.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 2e-2),
}


@pytest.fixture(scope="module")
def iq(triton_backend):
    from atom_kernels.backends.triton import int_quant

    return int_quant


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def wna16_weight(n, k, bits, groups, zeros, g_idx, seed, device, dtype=torch.float32):
    """(qweight, scales, zeros, g_idx): random words; scales giving ~unit outputs for unit x."""
    words = torch.randint(-(2**31), 2**31, (n, k * bits // 32), generator=_gen(seed))
    spread = 2 ** (bits - 1) / 3**0.5  # std of q - 2**(bits - 1), q uniform
    scales = (torch.rand(n, groups, generator=_gen(seed + 1)) + 0.5) / (spread * k**0.5)
    zero = torch.randint(0, 1 << bits, (n, groups), generator=_gen(seed + 2)).to(dtype)
    gi = torch.randint(0, groups, (k,), generator=_gen(seed + 3), dtype=torch.int32)
    return (
        words.to(torch.int32).to(device),
        scales.to(dtype).to(device),
        zero.to(device) if zeros else None,
        gi.to(device) if g_idx else None,
    )


def one_row_case(n, k, group, zeros, dtype, seed, device, every=53):
    """(qweight, scales, zeros, g_idx, x [1, K]) of a one-row test: groups of ``group`` (0:
    channel-wise), x with outliers (every ``every``-th value 20x)."""
    group = group or k
    qw, s, z, g = wna16_weight(n, k, 4, k // group, zeros, False, seed=seed, device=device,
                               dtype=dtype)  # fmt: skip
    x = torch.randn(1, k, generator=_gen(seed + 1))
    x[0, ::every] *= 20
    return qw, s, z, g, x.to(dtype).to(device)


# (bits, N, K, G, zeros, g_idx): groups 32 / 64 / 128 (tile-wide scales), channel-wise, a K not a
# multiple of the tile with per-element scales (K = 80, G = 1), act-order g_idx.
WNA16_CASES = [
    (4, 40, 256, 2, False, False), (4, 24, 128, 4, True, False), (4, 20, 96, 3, False, False),
    (4, 18, 80, 1, True, False), (4, 24, 128, 4, True, True), (8, 40, 256, 8, False, False),
    (8, 24, 96, 1, True, False), (8, 17, 60, 1, False, False), (8, 24, 128, 2, False, True),
]  # fmt: skip


@pytest.mark.parametrize(("bits", "n", "k", "groups", "zeros", "g_idx"), WNA16_CASES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_wna16_linear(triton_backend, iq, bits, n, k, groups, zeros, g_idx, rows):
    device = triton_backend.device
    dtype = [torch.bfloat16, torch.float16, torch.float32][(rows + n) % 3]  # each dtype per bits
    qw, s, z, g = wna16_weight(n, k, bits, groups, zeros, g_idx, seed=n + k, device=device,
                               dtype=dtype)  # fmt: skip
    x = torch.randn(rows, k, generator=_gen(rows)).to(dtype).to(device)
    bias = torch.randn(n, generator=_gen(3)).to(dtype).to(device) if rows != 5 else None
    out = iq.wna16_linear(x, qw, s, z, g, bits, bias)
    expected = reference.wna16_linear(x, qw, s, z, g, bits, bias)
    atol, rtol = TOLERANCES[dtype]
    assert out.dtype == dtype
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"wna16_linear {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "config",
    [None, dict(SPLIT_K=1), dict(SPLIT_K=3), dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64),
     dict(BLOCK_N=32, BLOCK_K=128, SPLIT_K=2), dict(BLOCK_M=32, BLOCK_N=16, GROUP_M=2)],
)  # fmt: skip
def test_wna16_linear_launches(triton_backend, iq, dtype, config):
    """One row through the multiply-add, the decode dot (scaled after the dot) and the prefill
    tiles (BLOCK_M 32: scaled weights), split or not (N = 24: the interpreter's 4 SMs take 2
    tiles, split by default), K = 384: 2 groups of 192, 12 K tiles of 32."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(24, 384, 4, 2, True, False, seed=5, device=device, dtype=dtype)
    x = torch.randn(1, 384, generator=_gen(6)).to(dtype).to(device)
    bias = torch.randn(24, generator=_gen(7)).to(dtype).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, bias)
    atol, rtol = TOLERANCES[dtype]
    for _ in range(2):  # twice: split-K's counters are back at zero after a call
        out = iq.wna16_linear(x, qw, s, z, g, 4, bias, config=config)
        assert_close(out, expected, atol=atol, rtol=rtol, name=f"wna16_linear {config}")


# (bits, zeros, groups) of the permuted K loop's cases at N = 24, K = 384: group 128 and 32,
# symmetric and asymmetric, 4- and 8-bit.
PERMUTED_CASES = [(4, False, 3), (4, True, 3), (4, False, 12), (4, True, 12), (8, True, 12)]
# rows, launch: one row through the multiply-adds (BLOCK_M 1) and the 16-row dots, 5 rows; K
# tiles of 32 (a group per tile; multiply-adds only: a GPU's dots are 16 words deep or more) and
# 128 (group 32: a group per word, scales gathered), split.
PERMUTED_LAUNCHES = [
    (1, dict(BLOCK_M=1, BLOCK_K=32, SPLIT_K=3)), (1, dict(BLOCK_M=1, BLOCK_K=128, SPLIT_K=2)),
    (1, dict(BLOCK_M=16, BLOCK_K=128, SPLIT_K=2)), (5, dict(BLOCK_K=128, SPLIT_K=3)),
    (5, dict(BLOCK_K=128, SPLIT_K=2)),
]  # fmt: skip


@pytest.mark.parametrize(("bits", "zeros", "groups"), PERMUTED_CASES)
@pytest.mark.parametrize(("rows", "launch"), PERMUTED_LAUNCHES)
@pytest.mark.parametrize("permuted", [True, False])
def test_wna16_linear_permuted_k(triton_backend, iq, bits, zeros, groups, rows, launch, permuted):
    """The decode K loop with no interleave (PERMUTED_K) and the interleaved one, forced, against
    the reference: the permutation of K inside a tile must meet x in the same order."""
    device = triton_backend.device
    dtype = DTYPES[(bits + groups + rows + len(launch)) % 3]
    qw, s, z, g = wna16_weight(24, 384, bits, groups, zeros, False, seed=40 + groups, device=device,
                               dtype=dtype)  # fmt: skip
    x = torch.randn(rows, 384, generator=_gen(41)).to(dtype).to(device)
    bias = torch.randn(24, generator=_gen(42)).to(dtype).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, bits, bias)
    config = dict(launch, PERMUTED_K=permuted, BLOCK_N=16)
    out = iq.wna16_linear(x, qw, s, z, g, bits, bias, config=config)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"wna16_linear {config} {dtype}")


@pytest.mark.parametrize("rows", [1, 5])
def test_wna16_linear_permuted_k_ragged_k(triton_backend, iq, rows):
    """K = 160 in 64-deep tiles (one row) or 128-deep (dots): the last tile partly past K (masked
    words and x), group 32."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(20, 160, 4, 5, True, False, seed=43, device=device)
    x = torch.randn(rows, 160, generator=_gen(44)).to(device)
    block_m, block_k = (1, 64) if rows == 1 else (16, 128)
    config = dict(BLOCK_M=block_m, BLOCK_K=block_k, PERMUTED_K=True, SPLIT_K=2)
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    assert_close(out, expected, atol=1e-4, rtol=1e-4)


def test_wna16_linear_permuted_k_refuses_what_it_cannot_order(triton_backend, iq):
    device = triton_backend.device
    qw, s, z, g = wna16_weight(16, 128, 4, 4, False, True, seed=45, device=device)
    x = torch.randn(1, 128, generator=_gen(46)).to(device)
    with pytest.raises(ValueError, match="PERMUTED_K"):  # g_idx: a word's k in many groups
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(PERMUTED_K=True))
    qw, s, z, g = wna16_weight(16, 128, 4, 1, False, False, seed=45, device=device)
    x4 = torch.randn(4, 128, generator=_gen(46)).to(device)
    with pytest.raises(ValueError, match="BLOCK_K >= 128"):  # 8-word dots: too shallow on a GPU
        iq.wna16_linear(x4, qw, s, z, g, 4, None, config=dict(PERMUTED_K=True, BLOCK_K=64))
    # Not asked for: a shallower K tile than the default takes the interleaved loop.
    out = iq.wna16_linear(x4, qw, s, z, g, 4, None, config=dict(BLOCK_K=64))
    assert_close(out, reference.wna16_linear(x4, qw, s, z, g, 4, None), atol=1e-4, rtol=1e-4)


# (zeros, groups, dtype) of the one-row loop without a subtraction a weight (SMALL_MAGIC) at N = 24,
# K = 384: group 128 and 32, symmetric and asymmetric, 16-bit and fp32 x.
SMALL_MAGIC_CASES = [
    (False, 3, torch.bfloat16), (True, 3, torch.float32), (False, 12, torch.float32),
    (True, 12, torch.bfloat16), (True, 3, torch.float16),
]  # fmt: skip
# K tiles of 32 (a group per tile) and 128 (group 32: a group per word, scales gathered), split or
# not, 2 stages (a GPU's pipelining; the interpreter runs it as 1).
SMALL_MAGIC_LAUNCHES = [
    dict(BLOCK_K=32, SPLIT_K=3), dict(BLOCK_K=128, SPLIT_K=2),
    dict(BLOCK_K=128, SPLIT_K=1, num_stages=2),
]  # fmt: skip
# SMALL_MAGIC's variants (int_quant_small_magic.SMALL_MAGIC_VARIANTS): none (the default), each,
# all that combine.
SMALL_MAGIC_VARIANTS = [
    {}, dict(X_VECTOR=True), dict(X_SPLIT=True), dict(PREFETCH=True),
    dict(X_VECTOR=True, PREFETCH=True), dict(X_VECTOR=True, k_stages=3),
]  # fmt: skip


@pytest.mark.parametrize(("zeros", "groups", "dtype"), SMALL_MAGIC_CASES)
@pytest.mark.parametrize("launch", SMALL_MAGIC_LAUNCHES)
@pytest.mark.parametrize("variant", SMALL_MAGIC_VARIANTS, ids=str)
def test_wna16_linear_small_magic(triton_backend, iq, zeros, groups, dtype, launch, variant):
    """The one-row multiply-adds on 2**(23 - p) + q with the magics and zeros taken off per
    column of x (SMALL_MAGIC) against the reference, and against the permuted loop it varies
    (the same fp32 weights: a few fp32 ulps of the output apart, not its dtype's)."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(24, 384, 4, groups, zeros, False, seed=60 + groups, device=device,
                               dtype=dtype)  # fmt: skip
    x = torch.randn(1, 384, generator=_gen(61)).to(dtype).to(device)
    bias = torch.randn(24, generator=_gen(62)).to(dtype).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, bias)
    config = dict(launch, BLOCK_M=1, BLOCK_N=16, PERMUTED_K=True, SMALL_MAGIC=True, **variant)
    out = iq.wna16_linear(x, qw, s, z, g, 4, bias, config=config)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"wna16_linear {config} {dtype}")
    if dtype == torch.float32:
        plain = dict(launch, BLOCK_M=1, BLOCK_N=16, PERMUTED_K=True)
        permuted = iq.wna16_linear(x, qw, s, z, g, 4, bias, config=plain)
        assert_close(out, permuted, atol=2e-5, rtol=2e-5, name="small magic vs permuted")


@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("variant", SMALL_MAGIC_VARIANTS, ids=str)
def test_wna16_linear_small_magic_ragged_k(triton_backend, iq, zeros, variant):
    """K = 160 in 64-deep tiles: the last tile partly past K (masked words read as 0, a value of
    2**(23 - p) met by x = 0), group 32; outliers in x (the correction cancels ~256 |x|)."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(20, 160, 4, 5, zeros, False, seed=63, device=device)
    x = torch.randn(1, 160, generator=_gen(64))
    x[0, ::37] *= 100
    x = x.to(device)
    config = dict(BLOCK_M=1, BLOCK_K=64, PERMUTED_K=True, SMALL_MAGIC=True, SPLIT_K=2, **variant)
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    expected = reference.wna16_linear(x.double(), qw, s.double(), None if z is None else z.double(),
                                      g, 4, None).float()  # fmt: skip
    assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_wna16_linear_small_magic_x_vector_unaligned(triton_backend, iq, dtype):
    """X_VECTOR reads x as 64-bit words: a row starting off a 16-byte boundary (a view one
    element in) is copied to an aligned one first, the result unchanged."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(16, 256, 4, 2, True, False, seed=69, device=device, dtype=dtype)
    x = torch.randn(1, 257, generator=_gen(70)).to(dtype).to(device)[:, 1:]
    config = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=64, PERMUTED_K=True, SMALL_MAGIC=True)
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(config, X_VECTOR=True))
    assert_close(out, iq.wna16_linear(x, qw, s, z, g, 4, None, config=config), atol=0, rtol=0)


# (zeros, group (0: channel-wise), dtype, N, K, SPLIT_K, BLOCK_N, warps) of the quads' MMAs
# (QUAD_MMA) under the interpreter: symmetric and asymmetric, bf16 and fp16, group 128, 256 and
# channel-wise, N not a multiple of the tile (rows past N read row N - 1, not stored), K split.
QUAD_MMA_CASES = [
    (False, 128, torch.bfloat16, 48, 384, 1, 16, 2),
    (True, 128, torch.float16, 40, 384, 3, 16, 2),
    (True, 256, torch.bfloat16, 72, 512, 2, 32, 4),
    (False, 0, torch.float16, 24, 256, 1, 32, 2),
    (True, 0, torch.bfloat16, 16, 384, 3, 16, 1),
    (True, 128, torch.bfloat16, 40, 1024, 3, 16, 2, 2),  # QUAD_STEP 2: splits of 4, 4
    (False, 256, torch.float16, 24, 512, 1, 16, 2, 2),
    (True, 128, torch.bfloat16, 24, 1536, 2, 16, 2, 4),  # 2 splits of 8 tiles, 4 a step
]  # fmt: skip


@pytest.mark.parametrize(("zeros", "group", "dtype", "n", "k", "split", "block_n", "warps",
                          "step"), [(*case, 1)[:9] for case in QUAD_MMA_CASES])  # fmt: skip
def test_wna16_linear_quad_mma(triton_backend, iq, zeros, group, dtype, n, k, split, block_n,
                               warps, step):  # fmt: skip
    """The quads' MMAs' bookkeeping (QUAD_MMA; the interpreter runs ``_quad_plain``, each row's
    dot placed where the MMAs place it, then read back per row) against the reference, with
    outliers in x, and bias."""
    device = triton_backend.device
    qw, s, z, g, x = one_row_case(n, k, group, zeros, dtype, 90 + n, device)
    bias = torch.randn(n, generator=_gen(92)).to(dtype).to(device)
    config = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, PERMUTED_K=True,
                  QUAD_MMA=True, SPLIT_K=split, QUAD_STEP=step)  # fmt: skip
    out = iq.wna16_linear(x, qw, s, z, g, 4, bias, config=config)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, bias)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol * 20, rtol=rtol, name=f"quad mma {config}")
    exact = reference.wna16_linear(x.double(), qw, s.double(), None if z is None else z.double(),
                                   g, 4, bias.double())  # fmt: skip
    # fp32 sums of exact products: the output's own rounding of the exact result, no more
    ulp = exact.abs().clamp_min(1.0) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert ((out.double() - exact).abs() <= ulp).all(), (out.double() - exact).abs().max()


def test_wna16_linear_quad_mma_refuses_what_it_cannot_take(triton_backend, iq):
    """QUAD_MMA asked for outside what its layout takes fails naming the need; the default
    path is untouched by it."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(16, 256, 4, 8, False, False, seed=93, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    quad = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=128, num_warps=2, PERMUTED_K=True, QUAD_MMA=True)
    x = torch.randn(1, 256, generator=_gen(94)).to(torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="multiples of 128"):  # group 32
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=quad)
    qw, s, z, g = wna16_weight(16, 256, 4, 2, False, False, seed=93, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="bf16 / fp16 x"):
        iq.wna16_linear(x.float(), qw, s.float(), z, g, 4, None, config=quad)
    with pytest.raises(ValueError, match="multiple of 8 \\* num_warps"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(quad, num_warps=4))
    with pytest.raises(ValueError, match="BLOCK_K 128"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(quad, BLOCK_K=64))
    with pytest.raises(ValueError, match="one row"):
        iq.wna16_linear(x.expand(2, -1), qw, s, z, g, 4, None, config=dict(quad, BLOCK_M=16))
    unaligned = torch.empty(16 * 32 + 1, dtype=torch.int32, device=device)[1:].view(16, 32)
    unaligned.copy_(qw)
    with pytest.raises(ValueError, match="16-byte aligned"):
        iq.wna16_linear(x, unaligned, s, z, g, 4, None, config=quad)
    padded = torch.zeros(16, 40, dtype=torch.int32, device=device)[:, :32]  # row stride 40
    padded.copy_(qw)
    with pytest.raises(ValueError, match="a row stride of a multiple of 16 words"):
        iq.wna16_linear(x, padded, s, z, g, 4, None, config=quad)
    qw, s, z, g = wna16_weight(16, 384, 4, 3, False, False, seed=93, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(1, 384, generator=_gen(94)).to(torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="QUAD_STEP 2 needs 1, 2, 4 or 8 and K a multiple of 256"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(quad, QUAD_STEP=2))


# (zeros, group (0: channel-wise), dtype, N, K, SPLIT_K, BLOCK_N, warps) of the MMAs a warp a
# row (ROW_MMA) under the interpreter: groups 32, 128 and channel-wise, symmetric and
# asymmetric, bf16 and fp16, N not a multiple of the tile, K split.
ROW_MMA_CASES = [
    (False, 128, torch.bfloat16, 10, 1024, 1, 4, 2),
    (True, 32, torch.float16, 12, 2048, 2, 8, 4),
    (True, 0, torch.bfloat16, 6, 3072, 3, 2, 2),
    (False, 64, torch.float16, 8, 2048, 1, 8, 8),
    (True, 128, torch.bfloat16, 6, 4096, 2, 2, 2, 2),  # ROW_STEP 2: 2 splits of 2 tiles
    (False, 32, torch.float16, 4, 4096, 1, 4, 4, 4),  # ROW_STEP 4: the 4 tiles in one step
]  # fmt: skip


@pytest.mark.parametrize(("zeros", "group", "dtype", "n", "k", "split", "block_n", "warps",
                          "step"), [(*case, 1)[:9] for case in ROW_MMA_CASES])  # fmt: skip
def test_wna16_linear_row_mma(triton_backend, iq, zeros, group, dtype, n, k, split, block_n,
                              warps, step):  # fmt: skip
    """The MMAs a warp a row's bookkeeping (ROW_MMA; the interpreter runs ``_row_plain``, each
    lane's dot at its first element) against the reference: the weights rounded to x's dtype
    as the reference rounds them, so only the sum's order differs."""
    device = triton_backend.device
    qw, s, z, g, x = one_row_case(n, k, group, zeros, dtype, 97 + n, device, every=71)
    bias = torch.randn(n, generator=_gen(99)).to(dtype).to(device)
    config = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024, num_warps=warps, PERMUTED_K=True,
                  ROW_MMA=True, SPLIT_K=split)  # fmt: skip
    if step > 1:
        config["ROW_STEP"] = step
    out = iq.wna16_linear(x, qw, s, z, g, 4, bias, config=config)
    weight = reference.dequantize_wna16(qw, s, z, g, 4, dtype).double()  # rounded to dtype
    exact = (x.double() @ weight.T + bias.double()).to(dtype)
    ulp = exact.double().abs().clamp_min(1.0) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert ((out.double() - exact.double()).abs() <= ulp).all()
    expected = reference.wna16_linear(x, qw, s, z, g, 4, bias)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol * 20, rtol=rtol, name=f"row mma {config}")


# (zeros, group (0: channel-wise), dtype, N, K, SPLIT_K, BLOCK_N, warps, step) of ROW_MMA with the
# scale after its MMAs (ROW_SCALE_AFTER): groups of 128 and 256 and channel-wise.
ROW_SCALE_AFTER_CASES = [
    (False, 128, torch.bfloat16, 10, 1024, 1, 4, 2, 1),
    (True, 0, torch.bfloat16, 6, 3072, 3, 2, 2, 1),
    (True, 256, torch.float16, 6, 4096, 2, 2, 2, 2),
]  # fmt: skip
# the same with the zero after the MMAs too (ROW_XSUM: bf16) and / or only the weights of a step
# loaded first (ROW_AHEAD: each tile's x at its math), as (case, config keys)
ROW_AFTER_CASES = [(case, dict(ROW_SCALE_AFTER=True)) for case in ROW_SCALE_AFTER_CASES] + [
    ((False, 128, torch.bfloat16, 10, 1024, 1, 4, 2, 1), dict(ROW_XSUM=True)),
    ((True, 0, torch.bfloat16, 6, 3072, 3, 2, 2, 1), dict(ROW_XSUM=True, ROW_AHEAD=True)),
    ((True, 256, torch.bfloat16, 6, 4096, 2, 2, 2, 1), dict(ROW_XSUM=True)),
    ((True, 256, torch.float16, 6, 4096, 1, 2, 2, 2), dict(ROW_SCALE_AFTER=True, ROW_AHEAD=True)),
    ((True, 128, torch.bfloat16, 6, 4096, 1, 4, 2, 4), dict(ROW_XSUM=True, ROW_AHEAD=True)),
]  # fmt: skip
# (zeros, group (0: channel-wise), dtype, N, K, SPLIT_K, BLOCK_N, warps) of ROW_MMA with lane l on
# words l + 32 i (ROW_STRIDED: each word its own group's scale): groups 32, 64, 128, channel-wise
ROW_STRIDED_CASES = [
    (False, 128, torch.bfloat16, 10, 1024, 1, 4, 2), (True, 32, torch.float16, 12, 2048, 2, 8, 4),
    (True, 0, torch.bfloat16, 6, 3072, 3, 2, 2), (False, 64, torch.float16, 8, 2048, 1, 8, 8),
]  # fmt: skip


@pytest.mark.parametrize(("zeros", "group", "dtype", "n", "k", "split", "block_n", "warps"),
                         ROW_STRIDED_CASES)  # fmt: skip
def test_wna16_linear_row_mma_strided(triton_backend, iq, zeros, group, dtype, n, k, split,
                                      block_n, warps):  # fmt: skip
    """ROW_MMA with lane l on words l, 32 + l, 64 + l, 96 + l of a tile (ROW_STRIDED; the
    interpreter runs each word's own scale and zero by plain ops): the weights rounded as the
    reference rounds them, so within the output's rounding of that exact product, and against
    the reference."""
    device = triton_backend.device
    qw, s, z, g, x = one_row_case(n, k, group, zeros, dtype, 131 + n, device, every=71)
    config = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024, num_warps=warps, PERMUTED_K=True,
                  ROW_MMA=True, SPLIT_K=split, ROW_STRIDED=True)  # fmt: skip
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    weight = reference.dequantize_wna16(qw, s, z, g, 4, dtype).double()  # rounded to dtype
    exact = (x.double() @ weight.T).to(dtype)
    ulp = exact.double().abs().clamp_min(1.0) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert ((out.double() - exact.double()).abs() <= ulp).all()
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol * 20, rtol=rtol, name=f"row mma strided {config}")
    if group % 128 == 0:  # (channel-wise too) where the scale after could run
        with pytest.raises(ValueError, match="ROW_STRIDED needs no ROW_SCALE_AFTER"):
            iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(config, ROW_SCALE_AFTER=True))
    with pytest.raises(ValueError, match=r"ROW_STRIDED needs one tile a step and k_stages 1"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(config, k_stages=2))


@pytest.mark.parametrize(("case", "keys"), ROW_AFTER_CASES, ids=str)
def test_wna16_linear_row_mma_scale_after(triton_backend, iq, case, keys):
    """ROW_MMA with the scale after the MMAs (the interpreter runs ``_row_plain``'s form of it;
    ROW_XSUM's zero after them too is the same sum there), alone or with a step's weights
    loaded first: within the output's rounding of the exact product of x and the unrounded weights
    (q - zero) * scale, and against the reference."""
    zeros, group, dtype, n, k, split, block_n, warps, step = case
    qw, s, z, g, x = one_row_case(n, k, group, zeros, dtype, 191 + n, triton_backend.device)
    config = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024, num_warps=warps, PERMUTED_K=True,
                  ROW_MMA=True, SPLIT_K=split, ROW_STEP=step, **keys)  # fmt: skip
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    weight = reference.dequantize_wna16(qw, s, z, g, 4, torch.float64)  # not rounded
    exact = x.double() @ weight.T
    ulp = exact.abs().clamp_min(1.0) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert ((out.double() - exact).abs() <= ulp).all(), (out.double() - exact).abs().max()
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol * 20, rtol=rtol, name=f"row mma {config}")


@pytest.mark.parametrize(("dtype", "scale", "rounded", "exact"), [
    (torch.float16, 1 + 2**-10, -512.0, -512.5), (torch.bfloat16, 1 + 2**-7, -512.0, -516.0),
])  # fmt: skip
def test_wna16_linear_row_scale_after_skips_the_weights_rounding(
    triton_backend, iq, monkeypatch, dtype, scale, rounded, exact
):
    """Half the weights 7 * scale (not a 16-bit float: rounded up by the reference), half -8 *
    scale (one), x all ones: the reference's rounded weights sum to `rounded`, the unrounded
    ones to `exact` (both 16-bit floats, every partial sum exact in fp32): ROW_MMA gives the
    first, with the scale after its MMAs the second."""
    device = triton_backend.device
    qw = torch.full((8, 128), 0x0F0F0F0F, dtype=torch.int32, device=device)  # q 15, 0, 15, 0...
    s = torch.full((8, 8), scale, dtype=dtype, device=device)  # groups of 128
    x = torch.ones(1, 1024, dtype=dtype, device=device)
    row = dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, num_warps=2, PERMUTED_K=True, ROW_MMA=True)
    assert_equal(reference.wna16_linear(x, qw, s, None, None, 4, None), x.new_full((1, 8), rounded))
    assert_equal(iq.wna16_linear(x, qw, s, None, None, 4, None, config=row),
                 x.new_full((1, 8), rounded))  # fmt: skip
    after = iq.wna16_linear(x, qw, s, None, None, 4, None, config=dict(row, ROW_SCALE_AFTER=True))
    assert_equal(after, x.new_full((1, 8), exact))
    # a GPU's default one-row launch (ROW_MMA; the interpreter's default is the multiply-adds)
    # takes it from the switch (ATOM_WNA16_ROW_SCALE_AFTER)
    default = iq.wna16_config(1, 8, 1024, 128, True, 132, False, 4, True, override=False,
                              quad=True, row_scales=True)  # fmt: skip
    assert default.get("ROW_MMA") and "ROW_SCALE_AFTER" not in default, default
    assert_equal(iq.wna16_linear(x, qw, s, None, None, 4, None, config=default),
                 x.new_full((1, 8), rounded))  # fmt: skip
    monkeypatch.setattr(iq, "ROW_SCALE_AFTER_ENABLED", True)
    assert_equal(iq.wna16_linear(x, qw, s, None, None, 4, None, config=default),
                 x.new_full((1, 8), exact))  # fmt: skip


def test_wna16_linear_row_mma_refuses_what_it_cannot_take(triton_backend, iq, monkeypatch):
    """ROW_MMA (and its ROW_SCALE_AFTER) asked for outside what its layout takes fails naming
    the need; the switch's ROW_SCALE_AFTER (ATOM_WNA16_ROW_SCALE_AFTER) is dropped there."""
    device = triton_backend.device
    row = dict(BLOCK_M=1, BLOCK_N=4, BLOCK_K=1024, num_warps=2, PERMUTED_K=True, ROW_MMA=True)
    qw, s, z, g = wna16_weight(8, 1024, 4, 8, False, False, seed=93, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(1, 1024, generator=_gen(94)).to(torch.bfloat16).to(device)
    with pytest.raises(ValueError, match="scales of its dtype"):
        iq.wna16_linear(x, qw, s.float(), z, g, 4, None, config=row)
    with pytest.raises(ValueError, match="multiple of num_warps"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(row, num_warps=8))
    with pytest.raises(ValueError, match="BLOCK_K 1024"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(row, BLOCK_K=128))
    padded = torch.zeros(8, 136, dtype=torch.int32, device=device)[:, :128]  # row stride 136
    padded.copy_(qw)
    with pytest.raises(ValueError, match="a row stride of a multiple of 16 words"):
        iq.wna16_linear(x, padded, s, z, g, 4, None, config=row)
    qw, s, z, g = wna16_weight(8, 1536, 4, 12, False, False, seed=93, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="K a multiple of 1024"):
        iq.wna16_linear(x.new_ones(1, 1536), qw, s, z, g, 4, None, config=row)
    qw, s, z, g = wna16_weight(8, 3072, 4, 24, False, False, seed=93, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="ROW_STEP 3 needs 1, 2, 4 or 8"):
        iq.wna16_linear(x.new_ones(1, 3072), qw, s, z, g, 4, None, config=dict(row, ROW_STEP=3))
    # ROW_STEP is at most: 3 tiles take one a step, the same sums as ROW_STEP 1
    x3 = torch.randn(1, 3072, generator=_gen(95)).to(torch.bfloat16).to(device)
    out = iq.wna16_linear(x3, qw, s, z, g, 4, None, config=dict(row, ROW_STEP=4))
    assert_equal(out, iq.wna16_linear(x3, qw, s, z, g, 4, None, config=row))
    # groups of 64
    qw, s, z, g = wna16_weight(8, 1024, 4, 16, False, False, seed=193, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    with pytest.raises(ValueError, match="ROW_SCALE_AFTER needs groups of a multiple of 128"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(row, ROW_SCALE_AFTER=True))
    multiply_adds = dict(row, ROW_MMA=False, BLOCK_N=64, BLOCK_K=128)
    with pytest.raises(ValueError, match="ROW_SCALE_AFTER needs ROW_MMA"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(multiply_adds, ROW_SCALE_AFTER=True))
    with pytest.raises(ValueError, match="ROW_XSUM needs groups of a multiple of 128"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(row, ROW_XSUM=True))
    with pytest.raises(ValueError, match="ROW_XSUM needs ROW_MMA"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(multiply_adds, ROW_XSUM=True))
    with pytest.raises(ValueError, match="ROW_AHEAD needs ROW_MMA"):
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(multiply_adds, ROW_AHEAD=True))
    before = iq.wna16_linear(x, qw, s, z, g, 4, None, config=row)
    monkeypatch.setattr(iq, "ROW_SCALE_AFTER_ENABLED", True)
    monkeypatch.setattr(iq, "ROW_XSUM_ENABLED", True)
    assert_equal(iq.wna16_linear(x, qw, s, z, g, 4, None, config=row), before)
    # XSUM takes bf16 x; AHEAD one stage
    qw, s, z, g = wna16_weight(8, 2048, 4, 16, True, False, seed=197, device=device,
                               dtype=torch.float16)  # fmt: skip
    x2 = torch.randn(1, 2048, generator=_gen(198)).to(torch.float16).to(device)
    with pytest.raises(ValueError, match=r"ROW_XSUM needs bf16 x \(got torch.float16\)"):
        iq.wna16_linear(x2, qw, s, z, g, 4, None, config=dict(row, ROW_XSUM=True))
    with pytest.raises(ValueError, match=r"ROW_AHEAD needs k_stages 1 \(got 2\)"):
        iq.wna16_linear(x2, qw, s, z, g, 4, None, config=dict(row, ROW_AHEAD=True, k_stages=2))
    fp16 = iq.wna16_linear(x2, qw, s, z, g, 4, None, config=row)  # the switch's XSUM dropped
    monkeypatch.setattr(iq, "ROW_XSUM_ENABLED", False)
    assert_equal(fp16, iq.wna16_linear(x2, qw, s, z, g, 4, None, config=row))


def test_wna16_linear_small_magic_refuses_other_launches(triton_backend, iq):
    device = triton_backend.device
    qw, s, z, g = wna16_weight(16, 128, 4, 1, False, False, seed=65, device=device)
    x = torch.randn(1, 128, generator=_gen(66)).to(device)
    with pytest.raises(ValueError, match="SMALL_MAGIC"):  # dots, not multiply-adds
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(SMALL_MAGIC=True, BLOCK_M=16))
    with pytest.raises(ValueError, match="SMALL_MAGIC"):  # the interleaved loop
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(SMALL_MAGIC=True, PERMUTED_K=False))
    qw8, s8, z8, g8 = wna16_weight(16, 128, 8, 1, False, False, seed=65, device=device)
    with pytest.raises(ValueError, match="4-bit"):
        iq.wna16_linear(x, qw8, s8, z8, g8, 8, None, config=dict(SMALL_MAGIC=True))
    with pytest.raises(ValueError, match="need SMALL_MAGIC"):  # a variant of the loop, alone
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(SMALL_MAGIC=False, X_VECTOR=True))


# (rows, groups of K = 512, launch) of the packed-unpack dots (PACKED_DOT): one row, a few, 16;
# group 128 and channel-wise; split K or not; 2 stages (a GPU's pipelining; the interpreter runs 1).
PACKED_DOT_CASES = [
    (1, 4, dict(BLOCK_K=128, SPLIT_K=3)), (3, 1, dict(BLOCK_K=128, SPLIT_K=1, num_stages=2)),
    (16, 4, dict(BLOCK_K=128, SPLIT_K=2)), (1, 1, dict(BLOCK_K=256, SPLIT_K=2)),
]  # fmt: skip


@pytest.mark.parametrize(("rows", "groups", "launch"), PACKED_DOT_CASES)
@pytest.mark.parametrize("zeros", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("x_split", [False, True])
def test_wna16_linear_packed_dot(triton_backend, iq, rows, groups, launch, zeros, dtype, x_split):
    """The 16-row dots of q - zero from the packed unpack (PACKED_DOT; the interpreter takes its
    shift-and-mask form, the same values) against the reference, and against the permuted dots
    of the fp32 unpack (the same exact q - zero, the same sums: a rounding of the output apart)."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(40, 512, 4, groups, zeros, False, seed=80 + rows, device=device,
                               dtype=dtype)  # fmt: skip
    x = torch.randn(rows, 512, generator=_gen(81)).to(dtype).to(device)
    bias = torch.randn(40, generator=_gen(82)).to(dtype).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, bias)
    config = dict(launch, BLOCK_M=16, BLOCK_N=16, PERMUTED_K=True, PACKED_DOT=True,
                  X_SPLIT=x_split)  # fmt: skip
    out = iq.wna16_linear(x, qw, s, z, g, 4, bias, config=config)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"wna16_linear {config} {dtype}")
    plain = dict(config, PACKED_DOT=False, X_SPLIT=False)
    permuted = iq.wna16_linear(x, qw, s, z, g, 4, bias, config=plain)
    assert_close(out.float(), permuted.float(), atol=atol / 4, rtol=rtol / 4, name="vs permuted")


def test_wna16_linear_packed_dot_refuses_what_it_cannot_take(triton_backend, iq):
    """PACKED_DOT asked for where it does not fit is a ValueError naming why; the default's
    (ATOM_WNA16_PACKED_DOT, a GPU's) is dropped instead."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(16, 256, 4, 4, False, False, seed=83, device=device)
    x = torch.randn(1, 256, generator=_gen(84)).to(device)
    packed = dict(PACKED_DOT=True, BLOCK_M=16, BLOCK_K=64)
    with pytest.raises(ValueError, match="bf16 / fp16 x"):  # fp32 x
        iq.wna16_linear(x, qw, s, z, g, 4, None, config=packed)
    xb = x.to(torch.bfloat16)
    with pytest.raises(ValueError, match="BLOCK_M 16"):
        iq.wna16_linear(xb, qw, s, z, g, 4, None, config=dict(packed, BLOCK_M=1))
    with pytest.raises(ValueError, match="dividing the group size"):  # group 64, BLOCK_K 128
        iq.wna16_linear(xb, qw, s, z, g, 4, None, config=dict(packed, BLOCK_K=128))
    with pytest.raises(ValueError, match="BLOCK_K >= 128"):  # dots 8 words deep
        iq.wna16_linear(xb, qw, s, z, g, 4, None, config=packed)
    packed["BLOCK_K"] = 128
    gi = torch.zeros(256, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="no g_idx"):
        iq.wna16_linear(xb, qw, s, z, gi, 4, None, config=packed)
    qw8, s8, _, _ = wna16_weight(16, 256, 8, 2, False, False, seed=83, device=device)
    with pytest.raises(ValueError, match="4-bit"):
        iq.wna16_linear(xb, qw8, s8, None, None, 8, None, config=packed)


def test_wna16_config_packed_dot_default():
    """On a GPU the default takes the packed dots at 2..PACKED_DOT_MAX_ROWS rows where it fits
    (4-bit, contiguous groups of a multiple of 128), the other loops elsewhere (one row: the
    multiply-adds)."""
    from atom_kernels.backends.triton import int_quant

    for rows in (2, 4, 16):
        cfg = int_quant.wna16_config(rows, 6144, 4096, 128, True, 132, packed_dot=True)
        assert cfg["PACKED_DOT"] and cfg["BLOCK_M"] == 16 and 128 % cfg["BLOCK_K"] == 0, cfg
    for args, kw in [((1, 6144, 4096, 32, True, 132), {}), ((1, 6144, 4096, 128, False, 132), {}),
                     ((1, 6144, 4096, 128, True, 132), dict(bits=8)),
                     ((17, 6144, 4096, 128, True, 132), {}),
                     ((1, 6144, 4096, 128, True, 132), {}),
                     ((1, 6144, 4096, 128, True, 132), dict(interpreted=True))]:  # fmt: skip
        assert not int_quant.wna16_config(*args, packed_dot=True, **kw).get("PACKED_DOT"), args
    assert not int_quant.wna16_config(1, 6144, 4096, 128, True, 132).get("PACKED_DOT")


def test_wna16_linear_split_k_is_deterministic(triton_backend, iq):
    device = triton_backend.device
    qw, s, z, g = wna16_weight(16, 512, 4, 4, False, False, seed=8, device=device)
    x = torch.randn(3, 512, generator=_gen(9)).to(device)
    first = iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(SPLIT_K=4))
    assert_equal(iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(SPLIT_K=4)), first)


def test_wna16_linear_leading_dims_strided_and_empty(triton_backend, iq):
    device = triton_backend.device
    qw, s, z, g = wna16_weight(20, 128, 8, 4, True, False, seed=10, device=device)
    x = torch.randn(2, 3, 128, generator=_gen(11)).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, 8, None)
    out = iq.wna16_linear(strided_copy(x), qw, s, z, g, 8, None)
    assert out.shape == (2, 3, 20)
    assert_close(out, expected, atol=1e-4, rtol=1e-4)
    # a strided qweight, scales, zeros and bias (every other column of wider buffers)
    bias = torch.randn(20, generator=_gen(12)).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, 8, bias)
    out = iq.wna16_linear(x, strided_copy(qw), strided_copy(s), strided_copy(z), g, 8,
                          strided_copy(bias))  # fmt: skip
    assert_close(out, expected, atol=1e-4, rtol=1e-4)
    assert iq.wna16_linear(x[:, :0], qw, s, z, g, 8, None).shape == (2, 0, 20)


def test_grouped_tile_order(triton_backend, iq):
    """GROUP_M > 1 (prefill's L2 order: row tiles walked per column) covers every tile once."""
    device = triton_backend.device
    qw, s, z, g = wna16_weight(40, 128, 4, 4, False, False, seed=33, device=device)
    x = torch.randn(50, 128, generator=_gen(34)).to(device)
    config = dict(BLOCK_M=16, BLOCK_N=16, GROUP_M=3, SPLIT_K=1)
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    assert_close(out, reference.wna16_linear(x, qw, s, z, g, 4, None), atol=1e-4, rtol=1e-4)
    w = torch.randint(-128, 128, (40, 64), generator=_gen(35), dtype=torch.int8).to(device)
    a, a_s = iq.quantize_int8(x[:, :64], None)
    w_s = torch.rand(40, generator=_gen(36)).to(device)
    expected = ((a.double() @ w.double().T) * a_s.double()[:, None] * w_s.double()).float()
    assert_equal(iq.int8_gemm(a, a_s, w, w_s, None, torch.float32, config), expected)


@pytest.mark.parametrize(("bits", "n", "k", "groups", "zeros", "g_idx"), WNA16_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_wna16(triton_backend, iq, bits, n, k, groups, zeros, g_idx, dtype):
    device = triton_backend.device
    qw, s, z, g = wna16_weight(n, k, bits, groups, zeros, g_idx, seed=n, device=device,
                               dtype=dtype)  # fmt: skip
    out = iq.dequantize_wna16(qw, s, z, g, bits, torch.float16)
    assert_equal(out, reference.dequantize_wna16(qw, s, z, g, bits, torch.float16))


# --- W8A8 -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_quantize_int8_bit_for_bit(triton_backend, iq, dtype, static):
    device = triton_backend.device
    x = (torch.randn(6, 300, generator=_gen(12)) * 4).to(dtype)
    x[1] = 0  # an all-zero row: scale 1e-10 / 127
    x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.5, -126.5])  # ties at scale 1
    x[2, 8:] = 0
    x = x.to(device)
    input_scale = torch.tensor([0.03], device=device) if static else None  # saturates
    q, s = iq.quantize_int8(x, input_scale)
    q_ref, s_ref = reference.quantize_int8_per_token(x, input_scale)
    assert_equal(s, s_ref.reshape(-1), name="scales")
    assert_equal(q, q_ref, name="q")
    q, _ = iq.quantize_int8(strided_copy(x), input_scale)
    assert_equal(q, q_ref, name="q (strided x)")


# bf16 maxima whose scale amax / 127 differs by 1 ulp from amax * fl(1 / 127), the division a
# CUDA torch made of `tensor / 127.0` (the reference's, before it divided by a tensor).
RECIPROCAL_MISSES = [0.55859375, 1.1171875, 1.6171875, 0.80859375]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_scale_is_a_true_division(triton_backend, iq, dtype):
    """Row scales are the IEEE quotient amax / 127 in the kernel and in the reference, on every
    device; with a bias the W8A8 linear matches the reference bit for bit on such rows (the GPU
    run of test_int8_linear_gpu_real_sizes failed on rows like these)."""
    device = triton_backend.device
    amax = torch.tensor(RECIPROCAL_MISSES)
    assert ((amax * torch.tensor(1 / 127.0)) != (amax.double() / 127).float()).all()
    x = (torch.rand(len(amax), 256, generator=_gen(50)) * 2 - 1) * amax[:, None]
    x[torch.arange(len(amax)), torch.arange(len(amax)) * 7] = -amax  # each row's |max|
    x = x.to(dtype).to(device)
    expected = (amax.double() / 127).float()
    _, s = iq.quantize_int8(x, None)
    assert_equal(s.cpu(), expected, name="kernel scales")
    _, s_ref = reference.quantize_int8_per_token(x, None)
    assert_equal(s_ref.reshape(-1).cpu(), expected, name="reference scales")
    w = torch.randint(-128, 128, (40, 256), generator=_gen(51), dtype=torch.int8).to(device)
    w_s = (torch.rand(40, generator=_gen(52)) / 1000).to(device)
    bias = torch.randn(40, generator=_gen(53)).to(dtype).to(device)
    out = iq.int8_linear(x, w, w_s, None, bias)
    assert_equal(out, reference.int8_linear(x, w, w_s, None, bias))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 24, 256), (5, 40, 100), (40, 24, 64)])
@pytest.mark.parametrize("static", [False, True])
def test_int8_linear_bit_for_bit(triton_backend, iq, dtype, rows, n, k, static):
    device = triton_backend.device
    x = (torch.randn(rows, k, generator=_gen(13)) * 2).to(dtype).to(device)
    w = torch.randint(-128, 128, (n, k), generator=_gen(14), dtype=torch.int8).to(device)
    w_s = (torch.rand(n, generator=_gen(15)) / 64 + 1e-3).to(device)
    bias = torch.randn(n, generator=_gen(16)).to(dtype).to(device) if rows != 5 else None
    input_scale = torch.tensor([0.02], device=device) if static else None
    out = iq.int8_linear(x, w, w_s, input_scale, bias)
    assert_equal(out, reference.int8_linear(x, w, w_s, input_scale, bias))
    if bias is not None and rows == 1:  # strided weight, scales and bias
        out = iq.int8_linear(x, strided_copy(w), strided_copy(w_s), input_scale, strided_copy(bias))
        assert_equal(out, reference.int8_linear(x, w, w_s, input_scale, bias))


@pytest.mark.parametrize("config", [dict(SPLIT_K=1), dict(SPLIT_K=4), dict(BLOCK_K=64)])
def test_int8_gemm_launches(triton_backend, iq, config):
    device = triton_backend.device
    a = torch.randint(-128, 128, (3, 320), generator=_gen(17), dtype=torch.int8).to(device)
    b = torch.randint(-128, 128, (20, 320), generator=_gen(18), dtype=torch.int8).to(device)
    a_s = torch.rand(3, generator=_gen(19)).to(device)
    b_s = torch.rand(20, generator=_gen(20)).to(device)
    expected = ((a.double() @ b.double().T) * a_s.double()[:, None] * b_s.double()).float()
    for _ in range(2):
        assert_equal(iq.int8_gemm(a, a_s, b, b_s, None, torch.float32, config), expected)


def test_custom_ops_opcheck(triton_backend, iq):
    """Schemas and fake implementations (torch.library.opcheck), and the registry's entries."""
    from atom_kernels import registry
    from atom_kernels.backends.triton import quant_custom_ops

    device = triton_backend.device
    ops = torch.ops.atom
    qw, s, z, g = wna16_weight(16, 64, 4, 2, True, True, seed=21, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(3, 64, generator=_gen(22)).to(torch.bfloat16).to(device)
    w8 = torch.randint(-128, 128, (16, 64), generator=_gen(23), dtype=torch.int8).to(device)
    w8_s = torch.rand(16, generator=_gen(24)).to(device)
    cases = [
        (ops.triton_wna16_linear, (x, qw, s, z, g, 4, None)),
        (ops.triton_wna16_linear, (x, qw, s, None, None, 4, x[0, :16].contiguous())),
        (ops.triton_dequantize_wna16, (qw, s, z, g, 4, torch.float16)),
        (ops.triton_int8_linear, (x, w8, w8_s, None, None)),
        (ops.triton_int8_linear, (x, w8, w8_s, torch.tensor([0.05], device=device), None)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    for name in ("wna16_linear", "int8_linear", "dequantize_wna16"):
        assert registry._IMPLS["triton"][name] is quant_custom_ops.ENTRIES[name]


# --- real layer shapes on a GPU -------------------------------------------------------------------

LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 4, 16, 300])
@pytest.mark.parametrize(("n", "k"), LLAMA3_8B)
def test_wna16_linear_gpu_real_sizes(triton_backend, iq, rows, n, k):
    qw, s, z, g = wna16_weight(n, k, 4, k // 128, False, False, seed=25, device="cuda",
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(rows, k, generator=_gen(26)).to(torch.bfloat16).cuda()
    out = iq.wna16_linear(x, qw, s, z, g, 4, None)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    assert_close(out, expected, atol=3e-2, rtol=2e-2, name=f"wna16_linear {rows}x{n}x{k}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16])
def test_wna16_linear_gpu_chained_in_a_graph(triton_backend, iq, rows):
    """Each GEMM reads the one before it: three chained in a CUDA graph with the input copied in
    first, replayed on new inputs, equal the reference's chain on each replay (the split-K
    counters set back by each launch's last program, every replay's outputs its own inputs').
    A launch that let a link start before the one before it ended (PDL without its wait) would
    read the previous replay's values."""
    k = 4096
    weights = [
        wna16_weight(
            k, k, 4, k // 128, zeros, False, seed=140 + i, device="cuda", dtype=torch.bfloat16
        )
        for i, zeros in enumerate((False, True, False))
    ]
    staged = torch.zeros(rows, k, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros_like(staged)

    def chain(h):
        for qw, s, z, g in weights:
            h = iq.wna16_linear(h, qw, s, z, g, 4, None)  # ~unit outputs (wna16_weight)
        return h

    def chain_from_staged():
        x.copy_(staged)
        return chain(x)

    chain_from_staged()  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain_from_staged()
    for seed in range(3):
        staged.copy_(torch.randn(rows, k, generator=_gen(150 + seed)).to(torch.bfloat16))
        graph.replay()
        expected = staged.clone()
        for qw, s, z, g in weights:
            expected = reference.wna16_linear(expected, qw, s, z, g, 4, None)
        assert_close(out, expected, atol=6e-2, rtol=4e-2, name=f"replay {seed}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wna16_linear_gpu_one_row_padded_and_offset(triton_backend, iq, dtype):
    """The one-row default with words in rows not 16-byte aligned (a padded view: the MMA
    loops' layout needs them, so the default falls back) and with x one element into a
    buffer (copied aligned): the reference's results."""
    n, k = 4096, 4096
    qw, s, z, g = wna16_weight(n, k, 4, k // 128, True, False, seed=106, device="cuda",
                               dtype=dtype)  # fmt: skip
    padded = torch.zeros(n, k // 8 + 4, dtype=torch.int32, device="cuda")[:, : k // 8]
    padded.copy_(qw)
    x = torch.randn(1, k + 1, generator=_gen(107)).to(dtype).cuda()[:, 1:]
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    atol, rtol = TOLERANCES[dtype]
    for weight in (qw, padded):
        out = iq.wna16_linear(x, weight, s, z, g, 4, None)
        assert_close(out, expected, atol=atol, rtol=rtol, name=f"stride {weight.stride(0)}")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize(("bits", "zeros", "g_idx"), [(8, True, False), (4, True, True)])
def test_wna16_linear_gpu_variants(triton_backend, iq, rows, bits, zeros, g_idx):
    n, k = 4096, 4096
    qw, s, z, g = wna16_weight(n, k, bits, k // 128, zeros, g_idx, seed=27, device="cuda",
                               dtype=torch.float16)  # fmt: skip
    x = torch.randn(rows, k, generator=_gen(28)).to(torch.float16).cuda()
    out = iq.wna16_linear(x, qw, s, z, g, bits, None)
    expected = reference.wna16_linear(x, qw, s, z, g, bits, None)
    assert_close(out, expected, atol=4e-3, rtol=4e-3, name=f"wna16_linear {bits}-bit {rows}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("rows", "config"),
    [(1, dict(PERMUTED_K=True, BLOCK_M=1, num_stages=1)),
     (1, dict(PERMUTED_K=True, BLOCK_M=1, BLOCK_N=256, num_stages=1)),
     (1, dict(PERMUTED_K=True)), (16, dict(PERMUTED_K=True, BLOCK_N=128, BLOCK_K=128)),
     (4, dict(PERMUTED_K=False))],
)  # fmt: skip
@pytest.mark.parametrize(
    ("bits", "group", "zeros"), [(4, 128, False), (4, 32, True), (8, 128, True)]
)
def test_wna16_linear_gpu_permuted_k(triton_backend, iq, rows, config, bits, group, zeros):
    """The decode K loops compiled: permuted multiply-adds and dots (group 32: a scale per word),
    and the interleaved loop they replace, at o_proj's size."""
    n, k = 4096, 4096
    qw, s, z, g = wna16_weight(n, k, bits, k // group, zeros, False, seed=47, device="cuda",
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(rows, k, generator=_gen(48)).to(torch.bfloat16).cuda()
    out = iq.wna16_linear(x, qw, s, z, g, bits, None, config=config)
    expected = reference.wna16_linear(x, qw, s, z, g, bits, None)
    assert_close(out, expected, atol=3e-2, rtol=2e-2, name=f"wna16_linear {config}")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [dict(BLOCK_N=256, num_warps=4, num_stages=1), dict(BLOCK_N=256, num_warps=4, num_stages=2),
     dict(BLOCK_N=128, num_warps=2, num_stages=1), dict(BLOCK_N=128, num_warps=4, num_stages=2)],
)  # fmt: skip
@pytest.mark.parametrize(("group", "zeros"), [(128, False), (128, True), (32, True)])
@pytest.mark.parametrize(("n", "k"), LLAMA3_8B)
@pytest.mark.parametrize("variant", SMALL_MAGIC_VARIANTS, ids=str)
def test_wna16_linear_gpu_small_magic(triton_backend, iq, config, group, zeros, n, k, variant):
    """The one-row loop without a subtraction a weight (SMALL_MAGIC) compiled, at the benchmark's
    launches and the Llama-3-8B sizes (split K as chosen)."""
    qw, s, z, g = wna16_weight(n, k, 4, k // group, zeros, False, seed=67, device="cuda",
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(1, k, generator=_gen(68)).to(torch.bfloat16).cuda()
    plain = dict(config, BLOCK_M=1, BLOCK_K=128, PERMUTED_K=True)
    config = dict(plain, SMALL_MAGIC=True, **variant)
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    assert_close(out, expected, atol=3e-2, rtol=2e-2, name=f"wna16_linear {config}")
    permuted = iq.wna16_linear(x, qw, s, z, g, 4, None, config=plain)
    assert_close(out.float(), permuted.float(), atol=1e-2, rtol=1e-2, name="vs permuted")


# (tile (BLOCK_N, warps, k_stages, programs an SM), dtype, group (0: channel-wise), zeros) of
# the quads' MMAs' GPU test: the benchmark's tiles, each form of the PTX (bf16 / fp16, zeros).
QUAD_MMA_GPU = [
    ((64, 4, 1, 4), torch.bfloat16, 128, False), ((64, 4, 1, 4), torch.bfloat16, 128, True),
    ((64, 4, 2, 8), torch.float16, 128, True), ((64, 4, 3, 4), torch.float16, 128, False),
    ((128, 4, 2, 4), torch.bfloat16, 0, False), ((128, 8, 1, 4), torch.bfloat16, 256, True),
    ((256, 8, 2, 2), torch.bfloat16, 128, False), ((32, 4, 1, 8), torch.bfloat16, 128, False),
    ((64, 2, 3, 8), torch.bfloat16, 128, True), ((64, 4, 2, 4, 2), torch.bfloat16, 128, True),
    ((128, 4, 2, 4, 2), torch.float16, 0, False), ((64, 4, 2, 8, 4), torch.bfloat16, 128, True),
    ((64, 4, 2, 8, 8), torch.float16, 256, False),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("tile", "dtype", "group", "zeros"), QUAD_MMA_GPU, ids=str)
@pytest.mark.parametrize(("n", "k"), [*LLAMA3_8B, (1000, 2048)])
def test_wna16_linear_gpu_quad_mma(triton_backend, iq, tile, dtype, group, zeros, n, k):
    """The quads' MMAs' PTX (QUAD_MMA, ASM: the register layout it relies on, the shuffles of
    the scales) at the Llama-3-8B sizes and a ragged N: within the output's rounding of the
    exact result (fp64), and against the reference."""
    block_n, warps, k_stages, per_sm, step = (*tile, 1)[:5]
    group = group or k
    qw, s, z, g = wna16_weight(n, k, 4, k // group, zeros, False, seed=95, device="cuda",
                               dtype=dtype)  # fmt: skip
    x = torch.randn(1, k, generator=_gen(96)).to(dtype).cuda()
    config = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=1,
                  k_stages=k_stages, per_sm=per_sm, fill=True, SPLIT_K=None, PERMUTED_K=True,
                  QUAD_MMA=True, QUAD_STEP=step)  # fmt: skip
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"quad mma {config}")
    exact = reference.wna16_linear(x.double(), qw, s.double(), None if z is None else z.double(),
                                   g, 4, None)  # fmt: skip
    ulp = exact.abs().clamp_min(1.0) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert ((out.double() - exact).abs() <= ulp).all(), (out.double() - exact).abs().max()


# (tile (BLOCK_N, warps, k_stages, programs an SM), dtype, group (0: channel-wise), zeros) of
# the MMAs a warp a row's GPU test: the benchmark's tiles, each form of the PTX, group 32.
ROW_MMA_GPU = [
    ((8, 4, 1, 8), torch.bfloat16, 128, False), ((8, 4, 2, 8), torch.bfloat16, 128, True),
    ((16, 4, 3, 4), torch.float16, 32, True), ((32, 8, 2, 4), torch.float16, 128, False),
    ((4, 4, 2, 16), torch.bfloat16, 0, False), ((16, 8, 2, 8), torch.bfloat16, 32, False),
    ((8, 4, 1, 8, 2), torch.bfloat16, 128, True), ((8, 4, 1, 8, 4), torch.float16, 32, False),
]  # fmt: skip


# (tile as ROW_MMA_GPU's, dtype, group (0: channel-wise), zeros) of ROW_MMA with the scale after
# its MMAs on a GPU: the default tile in each PTX form, pipelined, 2 tiles a step, channel-wise.
ROW_SCALE_AFTER_GPU = [
    ((8, 4, 1, 8), torch.bfloat16, 128, False), ((8, 4, 1, 8), torch.bfloat16, 128, True),
    ((8, 4, 1, 8), torch.float16, 128, False), ((8, 4, 1, 8), torch.float16, 128, True),
    ((8, 4, 2, 8), torch.bfloat16, 256, True), ((4, 4, 2, 16), torch.bfloat16, 0, False),
    ((8, 4, 1, 8, 2), torch.bfloat16, 128, True),
]  # fmt: skip
# (tile, dtype, group, zeros) of ROW_MMA with the zero and the scale after its MMAs (ROW_XSUM,
# bf16) on a GPU: both PTX forms at the default tile and at 4 rows a warp, channel-wise, group
# 256; and (tile, dtype, group, zeros, keys) with a step's weights first (ROW_AHEAD)
ROW_XSUM_GPU = [
    ((8, 4, 1, 8), torch.bfloat16, 128, False), ((8, 4, 1, 8), torch.bfloat16, 128, True),
    ((16, 4, 1, 8), torch.bfloat16, 128, False), ((16, 4, 1, 8), torch.bfloat16, 128, True),
    ((32, 8, 1, 4), torch.bfloat16, 0, True), ((8, 4, 1, 8), torch.bfloat16, 256, True),
]  # fmt: skip
# (tile, dtype, group, zeros) of ROW_MMA with lane l on words l + 32 i (ROW_STRIDED) on a GPU
ROW_STRIDED_GPU = [
    ((8, 4, 1, 8), torch.bfloat16, 128, False), ((8, 4, 1, 8), torch.bfloat16, 128, True),
    ((8, 4, 1, 8), torch.float16, 32, True), ((16, 4, 1, 8), torch.bfloat16, 0, False),
    ((4, 4, 1, 16), torch.float16, 128, False), ((16, 8, 1, 8), torch.bfloat16, 64, True),
]  # fmt: skip
ROW_AHEAD_GPU = [
    ((8, 4, 1, 8, 2), torch.bfloat16, 128, True, {}),
    ((16, 4, 1, 8, 4), torch.float16, 32, False, {}),
    ((8, 4, 1, 8, 2), torch.bfloat16, 128, False, dict(ROW_XSUM=True)),
    ((8, 4, 1, 8, 4), torch.bfloat16, 128, True, dict(ROW_XSUM=True)),
    ((4, 4, 1, 16, 4), torch.bfloat16, 0, False, dict(ROW_XSUM=True)),
    ((8, 4, 1, 8, 2), torch.float16, 128, True, dict(ROW_SCALE_AFTER=True)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("tile", "dtype", "group", "zeros", "keys"),
                         [(*case, {}) for case in ROW_MMA_GPU]
                         + [(*case, dict(ROW_SCALE_AFTER=True)) for case in ROW_SCALE_AFTER_GPU]
                         + [(*case, dict(ROW_XSUM=True)) for case in ROW_XSUM_GPU]
                         + [(*case[:4], dict(case[4], ROW_AHEAD=True)) for case in ROW_AHEAD_GPU]
                         + [(*case, dict(ROW_STRIDED=True)) for case in ROW_STRIDED_GPU],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize(("n", "k"), [*LLAMA3_8B, (1000, 2048)])
def test_wna16_linear_gpu_row_mma(triton_backend, iq, tile, dtype, group, zeros, keys, n, k):
    """The MMAs a warp a row's PTX (ROW_MMA, ASM: the layout it relies on, the diagonal pick,
    x and the scales loaded in the words' layout; ``keys``: the scale after the MMAs,
    ROW_SCALE_AFTER, the zero too, ROW_XSUM, a step's weights first, ROW_AHEAD, lane l on words
    l + 32 i, ROW_STRIDED) at the
    Llama-3-8B sizes and a ragged N: within the output's rounding of the exact product of x and
    the weights (the reference's rounded ones; after the MMAs the unrounded ones), and against
    the reference."""
    after = bool(keys.get("ROW_SCALE_AFTER") or keys.get("ROW_XSUM"))
    block_n, warps, k_stages, per_sm, step = (*tile, 1)[:5]
    group = group or k
    qw, s, z, g = wna16_weight(n, k, 4, k // group, zeros, False, seed=101, device="cuda",
                               dtype=dtype)  # fmt: skip
    x = torch.randn(1, k, generator=_gen(102)).to(dtype).cuda()
    config = dict(BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=1024, num_warps=warps, num_stages=1,
                  k_stages=k_stages, per_sm=per_sm, fill=True, SPLIT_K=None, PERMUTED_K=True,
                  ROW_MMA=True, ROW_STEP=step if k % (step * 1024) == 0 else 1,
                  **keys)  # fmt: skip
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"row mma {config}")
    weight = reference.dequantize_wna16(qw, s, z, g, 4, torch.float64 if after else dtype)
    exact = x.double() @ weight.double().T
    ulp = exact.abs().clamp_min(1.0) * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    assert ((out.double() - exact).abs() <= ulp).all(), (out.double() - exact).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("zeros", [False, True])
def test_wna16_linear_gpu_row_xsum_cancels_the_magic(triton_backend, iq, zeros):
    """ROW_XSUM's MMAs sum x (128 + q) and take (128 + zero) x-sum off: with x all positive
    (every chunk's x-sum ~128 x its mean, the dot ~1/30 of what comes off) the result is still
    within the output's rounding of the exact product, at the gate_up shape."""
    n, k = 28672, 4096
    qw, s, z, g = wna16_weight(n, k, 4, k // 128, zeros, False, seed=111, device="cuda",
                               dtype=torch.bfloat16)  # fmt: skip
    x = (4.0 + torch.rand(1, k, generator=_gen(112))).to(torch.bfloat16).cuda()
    config = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=1024, num_warps=4, num_stages=1, per_sm=8,
                  fill=True, SPLIT_K=None, PERMUTED_K=True, ROW_MMA=True,
                  ROW_XSUM=True)  # fmt: skip
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    exact = x.double() @ reference.dequantize_wna16(qw, s, z, g, 4, torch.float64).T
    ulp = exact.abs().clamp_min(1.0) * 2**-7
    assert ((out.double() - exact).abs() <= ulp).all(), (out.double() - exact).abs().max()


# (tile (BLOCK_N, warps, stages), dtype, group (0: channel-wise), zeros) of the packed dots' GPU
# test: the default tile in every form, the benchmark's other tiles in the default's.
PACKED_DOT_GPU = [
    ((128, 4, 4), torch.bfloat16, 128, False), ((128, 4, 4), torch.bfloat16, 128, True),
    ((128, 4, 4), torch.float16, 128, True), ((128, 4, 4), torch.bfloat16, 0, False),
    ((256, 8, 3), torch.bfloat16, 128, False), ((64, 4, 4), torch.bfloat16, 128, False),
]  # fmt: skip
# (tile, dtype, group, zeros) of the same with X_SPLIT (x as one [16, BLOCK_K / 8, 8] load)
PACKED_DOT_X_SPLIT_GPU = [
    ((128, 4, 4), torch.bfloat16, 128, False), ((128, 4, 4), torch.float16, 128, True),
    ((128, 4, 3), torch.bfloat16, 0, True),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize(("tile", "dtype", "group", "zeros"), PACKED_DOT_GPU, ids=str)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize(("n", "k"), LLAMA3_8B)
def test_wna16_linear_gpu_packed_dot(triton_backend, iq, tile, dtype, group, zeros, rows, n, k):
    """The packed unpack's PTX (PACKED_DOT, ASM) at the Llama-3-8B sizes, channel-wise too (group
    0: K): against the reference, and against the fp32-unpack permuted dots (the same exact
    q - zero in the same dots: a rounding of the output apart)."""
    block_n, warps, stages = tile
    config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=stages,
                  PERMUTED_K=True, SPLIT_K=None, PACKED_DOT=True)  # fmt: skip
    _check_packed_dot_gpu(iq, config, dtype, group, zeros, rows, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize(("tile", "dtype", "group", "zeros"), PACKED_DOT_X_SPLIT_GPU, ids=str)
@pytest.mark.parametrize("rows", [1, 5, 16])
@pytest.mark.parametrize(("n", "k"), LLAMA3_8B)
def test_wna16_linear_gpu_packed_dot_x_split(triton_backend, iq, tile, dtype, group, zeros, rows,
                                             n, k):  # fmt: skip
    """The same with x as one load split in registers (X_SPLIT), K split to fill the SMs."""
    block_n, warps, stages = tile
    config = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=128, num_warps=warps, num_stages=stages,
                  PERMUTED_K=True, SPLIT_K=None, PACKED_DOT=True, X_SPLIT=True, fill=True,
                  per_sm=4)  # fmt: skip
    _check_packed_dot_gpu(iq, config, dtype, group, zeros, rows, n, k)


def _check_packed_dot_gpu(iq, config, dtype, group, zeros, rows, n, k):
    group = group or k
    qw, s, z, g = wna16_weight(n, k, 4, k // group, zeros, False, seed=85, device="cuda",
                               dtype=dtype)  # fmt: skip
    x = torch.randn(rows, k, generator=_gen(86)).to(dtype).cuda()
    out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=config)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    atol, rtol = TOLERANCES[dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, name=f"packed dot {config}")
    plain = dict(config, PACKED_DOT=False, X_SPLIT=False)
    permuted = iq.wna16_linear(x, qw, s, z, g, 4, None, config=plain)
    assert_close(out.float(), permuted.float(), atol=atol / 4, rtol=rtol / 4, name="vs permuted")


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 16, 256])
@pytest.mark.parametrize(("n", "k"), LLAMA3_8B)
def test_int8_linear_gpu_real_sizes(triton_backend, iq, rows, n, k):
    x = torch.randn(rows, k, generator=_gen(29)).to(torch.bfloat16).cuda()
    w = torch.randint(-128, 128, (n, k), generator=_gen(30), dtype=torch.int8).cuda()
    w_s = (torch.rand(n, generator=_gen(31)) / 1000).cuda()
    bias = torch.randn(n, generator=_gen(32)).to(torch.bfloat16).cuda()
    out = iq.int8_linear(x, w, w_s, None, bias)
    assert_equal(out, reference.int8_linear(x, w, w_s, None, bias))


def test_launch_policy(triton_backend, iq):
    """On an H100 (132 SMs) the decode launches of the Llama-3-8B shapes fill the SMs: one row
    the permuted multiply-adds 256 wide, 16 rows the interleaved 16-row dots, a tile-wide scale
    (BLOCK_K divides the group), K split where the N tiles are too few; prefill takes big tiles
    unsplit; odd groups fall back to a 32-deep K tile."""
    for rows in (1, 16):
        for n, k in LLAMA3_8B:
            cfg = iq.wna16_config(rows, n, k, 128, True, 132)
            assert cfg["BLOCK_M"] == (1 if rows == 1 else 16) and 128 % cfg["BLOCK_K"] == 0, cfg
            assert cfg["PERMUTED_K"] == (rows == 1) and cfg["BLOCK_N"] == (256 if rows == 1 else 64)
            programs = -(-n // cfg["BLOCK_N"]) * cfg["SPLIT_K"]
            assert programs >= 132 and cfg["SPLIT_K"] <= k // cfg["BLOCK_K"] // 2, (n, k, cfg)
    cfg = iq.wna16_config(4096, 4096, 4096, 128, True, 132)
    assert cfg["BLOCK_M"] == 128 and cfg["SPLIT_K"] == 1
    # decode: the permuted K loop wherever a word lies in one group, 128-deep K tiles
    for group, bits in ((128, 4), (32, 4), (40, 4), (36, 8)):
        cfg = iq.wna16_config(4, 4096, 4096, group, True, 132, bits=bits)
        assert cfg["PERMUTED_K"] and cfg["BLOCK_K"] == 128, (group, bits, cfg)
    cfg = iq.wna16_config(4, 4096, 4096, 44, True, 132)  # a word across two groups
    assert not cfg["PERMUTED_K"] and cfg["BLOCK_K"] == 32
    assert not iq.wna16_config(4, 4096, 4096, 128, False, 132)["PERMUTED_K"]  # g_idx
    assert not iq.wna16_config(300, 4096, 4096, 128, True, 132)["PERMUTED_K"]  # prefill
    assert iq.split_for(200, 64, 132, 2) == 1
    assert iq.split_for(64, 32, 132, 2) == 5 and iq.split_for(64, 4, 132, 2) == 2
    for rows in (1, 16, 256):
        cfg = iq.int8_gemm_config(rows, 4096, 4096, 132)
        assert -(-rows // cfg["BLOCK_M"]) * -(-4096 // cfg["BLOCK_N"]) * cfg["SPLIT_K"] >= 132


def test_one_row_override(monkeypatch):
    """ATOM_WNA16_ONE_ROW's launch replaces the one-row 4-bit default (K split to about per_sm
    programs an SM, loads pipelined) and nothing else; a malformed value fails naming the form."""
    from atom_kernels.backends.triton import int_quant as iq

    override = iq._one_row_override("128,4,3,2")
    assert override == dict(BLOCK_N=128, num_warps=4, k_stages=3, per_sm=2, fill=True)
    assert iq._one_row_override("64,4,2,8,quad") == dict(
        BLOCK_N=64, num_warps=4, k_stages=2, per_sm=8, fill=True, QUAD_MMA=True, QUAD_STEP=1
    )
    assert iq._one_row_override("64,4,2,8,quad4")["QUAD_STEP"] == 4
    row = dict(BLOCK_N=8, num_warps=4, k_stages=2, per_sm=8, fill=True, ROW_MMA=True,
               BLOCK_K=1024, ROW_STEP=1)  # fmt: skip
    assert iq._one_row_override("8,4,2,8,row") == row
    assert "ROW_TMA" not in iq._one_row_override("8,4,3,8,row")  # measured slower: removed
    assert iq._one_row_override("8,4,1,8,row4")["ROW_STEP"] == 4
    bad_specs = ("128,4,3", "128,4,0,2", "a,4,3,2", "100,4,3,2", "128,3,3,2", "128,4,3,2,x",
                 "128,4,3,2,quad3", "8,4,1,8,row3", "8,4,3,8,rowtma")  # fmt: skip
    for bad in ("16,4,1,8,quad", "4,8,1,8,row"):  # tiles the mode's layout cannot take
        with pytest.raises(ValueError, match="block_n must be a multiple of"):
            iq._one_row_override(bad)
    for bad in bad_specs:
        with pytest.raises(ValueError, match=r"k_stages,per_sm\[,mode\]"):
            iq._one_row_override(bad)
    assert iq._one_row_override("") is None
    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", override)
    one_row = iq.wna16_config(1, 4096, 4096, 128, True, 132)
    assert one_row["k_stages"] == 3 and one_row["BLOCK_N"] == 128 and one_row["X_VECTOR"]
    assert "k_stages" not in iq.wna16_config(4, 4096, 4096, 128, True, 132)
    assert "k_stages" not in iq.wna16_config(1, 4096, 4096, 128, True, 132, bits=8)
    assert "k_stages" not in iq.wna16_config(1, 4096, 4096, 128, True, 132, override=False)


def test_quad_mma_default(monkeypatch):
    """One row of 4-bit weights where the quads' MMAs can run (``quad``: 16-bit x on NVIDIA)
    takes them by default, with groups of a multiple of 128 and K of 256; anything else keeps
    the multiply-adds (X_VECTOR); ATOM_WNA16_ONE_ROW without ``quad`` keeps its own loop, with
    it its tiles on the MMAs."""
    from atom_kernels.backends.triton import int_quant as iq

    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", None)
    cfg = iq.wna16_config(1, 4096, 4096, 128, True, 132, quad=True)
    assert cfg["ROW_MMA"] and cfg["BLOCK_K"] == 1024 and cfg["BLOCK_N"] % cfg["num_warps"] == 0
    assert iq.wna16_config(1, 4096, 14336, 14336, True, 132, quad=True)["ROW_MMA"]  # channel
    assert iq.wna16_config(1, 4096, 4096, 32, True, 132, quad=True)["ROW_MMA"]  # group 32
    # K of 256, not 1024, or scales of another dtype: the quads'
    for cfg in (
        iq.wna16_config(1, 4096, 4352, 128, True, 132, quad=True),
        iq.wna16_config(1, 4096, 4096, 128, True, 132, quad=True, row_scales=False),
    ):
        assert cfg["QUAD_MMA"] and not cfg.get("ROW_MMA") and cfg["BLOCK_K"] == 128
        assert cfg["QUAD_STEP"] == iq.QUAD_DEFAULT_STEP and cfg["SPLIT_K"] >= 1
        assert cfg["BLOCK_N"] % (8 * cfg["num_warps"]) == 0
    for other in (
        iq.wna16_config(1, 4096, 4096, 128, True, 132),  # no quad: not 16-bit x / not NVIDIA
        iq.wna16_config(1, 4096, 4096, 32, True, 132, quad=True, row_scales=False),  # group 32
        iq.wna16_config(1, 4096, 4224, 128, True, 132, quad=True),  # K = 33 tiles: not 256
        iq.wna16_config(1, 4096, 4096, 128, True, 132, bits=8, quad=True),
        iq.wna16_config(1, 4096, 4096, 128, False, 132, quad=True),  # g_idx
    ):
        assert not other.get("QUAD_MMA")
    assert not iq.wna16_config(2, 4096, 4096, 128, True, 132, quad=True).get("QUAD_MMA")
    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", iq._one_row_override("128,4,3,2"))
    cfg = iq.wna16_config(1, 4096, 4096, 128, True, 132, quad=True)
    assert not cfg.get("QUAD_MMA") and not cfg.get("ROW_MMA") and cfg["X_VECTOR"]
    assert cfg["BLOCK_N"] == 128
    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", iq._one_row_override("32,4,3,4,quad4"))
    cfg = iq.wna16_config(1, 4096, 4096, 128, True, 132, quad=True)
    assert cfg["QUAD_MMA"] and cfg["QUAD_STEP"] == 4 and cfg["BLOCK_N"] == 32
    assert not cfg.get("ROW_MMA")
    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", iq._one_row_override("16,8,2,4,row"))
    cfg = iq.wna16_config(1, 4096, 4096, 128, True, 132, quad=True)
    assert cfg["ROW_MMA"] and cfg["BLOCK_N"] == 16 and cfg["k_stages"] == 2
    # a mode's override where its loop does not fit: the default chain, none of its keys
    cfg = iq.wna16_config(1, 4096, 4352, 128, True, 132, quad=True)  # K of 256, not 1024
    assert cfg["QUAD_MMA"] and cfg["BLOCK_N"] == 64 and not cfg.get("ROW_MMA")
    cfg = iq.wna16_config(1, 4096, 4096, 128, True, 132)  # no MMA here
    assert cfg["X_VECTOR"] and cfg["BLOCK_N"] == 256 and cfg["BLOCK_K"] == 128
    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", iq._one_row_override("32,4,3,4,quad4"))
    cfg = iq.wna16_config(1, 4096, 4096, 32, True, 132, quad=True)  # group 32: not the quads'
    assert cfg["X_VECTOR"] and cfg["BLOCK_N"] == 256 and not cfg.get("QUAD_MMA")
    # an explicit config's loop (mma): the one it names, whatever fits, none of the others' keys
    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", None)
    cfg = iq.wna16_config(1, 4096, 4096, 128, True, 132, quad=True, mma="quad")
    assert cfg["QUAD_MMA"] and not cfg.get("ROW_MMA") and cfg["BLOCK_K"] == 128
    cfg = iq.wna16_config(1, 4096, 4096, 128, True, 132, quad=True, mma="")
    assert cfg["X_VECTOR"] and not cfg.get("QUAD_MMA") and not cfg.get("ROW_MMA")
    assert iq.wna16_config(1, 4096, 4352, 128, True, 132, quad=True, mma="row")["ROW_MMA"]


def test_mma_loops_under_explicit_configs(triton_backend, iq, monkeypatch):
    """wna16_linear passes an explicit config's loop to wna16_config (ROW_MMA, else QUAD_MMA,
    else "": the multiply-adds, also for QUAD_MMA False), a real launch each (a spy on
    wna16_config), against the reference."""
    seen = []
    config_fn = iq.wna16_config

    def spy(*args, **kwargs):
        seen.append(kwargs.get("mma"))
        return config_fn(*args, **kwargs)

    monkeypatch.setattr(iq, "wna16_config", spy)
    device = triton_backend.device
    qw, s, z, g = wna16_weight(16, 1024, 4, 8, False, False, seed=104, device=device,
                               dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(1, 1024, generator=_gen(105)).to(torch.bfloat16).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    base = dict(BLOCK_M=1, BLOCK_N=16, num_warps=2, PERMUTED_K=True)
    for extra, mma in (
        (dict(ROW_MMA=True, BLOCK_K=1024), "row"), (dict(QUAD_MMA=True, BLOCK_K=128), "quad"),
        (dict(QUAD_MMA=False, BLOCK_K=128), ""), (dict(BLOCK_K=128), ""),
    ):  # fmt: skip
        out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(base, **extra))
        assert seen[-1] == mma, (extra, seen[-1])
        assert_close(out, expected, atol=3e-2, rtol=2e-2, name=str(extra))
    iq.wna16_linear(x, qw, s, z, g, 4, None)
    assert seen[-1] is None  # no config: the default chain


def test_k_stages_reach_the_kernel(triton_backend, iq, monkeypatch):
    """wna16_linear passes a config's ``k_stages`` to the kernel as K_STAGES (1 without it), and
    an explicit config takes none of ATOM_WNA16_ONE_ROW's keys; the real kernel runs (a spy on
    its launch), against the reference."""
    launches = []
    kernel = iq._wna16_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(kwargs)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(iq, "_wna16_kernel", Spy())
    monkeypatch.setattr(iq, "ONE_ROW_OVERRIDE", dict(BLOCK_N=32, k_stages=4, per_sm=1, fill=True))
    device = triton_backend.device
    qw, s, z, g = wna16_weight(24, 256, 4, 2, False, False, seed=70, device=device)
    x = torch.randn(1, 256, generator=_gen(71)).to(device)
    expected = reference.wna16_linear(x, qw, s, z, g, 4, None)
    config = dict(BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, PERMUTED_K=True, SMALL_MAGIC=True,
                  X_VECTOR=True)  # fmt: skip
    for extra, stages in (({"k_stages": 3}, 3), ({}, 1)):
        out = iq.wna16_linear(x, qw, s, z, g, 4, None, config=dict(config, **extra))
        assert launches[-1]["K_STAGES"] == stages and launches[-1]["BLOCK_N"] == 16
        assert_close(out, expected, atol=1e-4, rtol=1e-4, name=f"k_stages {stages}")


# --- the fragment layout (ops/int_quant_frag.py) ------------------------------------------------
# The repack is a permutation its inverse undoes, a word sits where the layout's docstring says,
# the torch backend on it gives the rows layout's results exactly, and the Triton fragment kernel
# (1-8 rows), the interleaved loop reading it (prefill) and its dequantization match the
# reference. Under the interpreter the fragment kernel runs its plain-op emulation of the PTX; on
# a GPU the PTX (the ``gpu`` tests at Llama-3-8B's shapes, split and chained in a CUDA graph).


def _case(n, k, groups, zeros, dtype, seed, device):
    qw, s, z, _ = wna16_weight(n, k, 4, groups, zeros, False, seed=seed, device=device,
                               dtype=dtype)  # fmt: skip
    return qw, s, z, *wna16_to_frag(qw, s, z)


def test_frag_round_trip_and_placement():
    """The inverse undoes the repack; lane 4g + c, word 2hi + jj of block b, step s is the rows
    layout's word 8s + 2c + jj of row 16b + g + 8hi, nibble p holding value 2p / 2(p - 4) + 1."""
    qw, s, z, qf, sf, zf = _case(48, 256, 2, True, torch.bfloat16, 3, "cpu")
    assert qf.shape == (3, 4, 32, 4) and sf.shape == (3, 2, 8, 2) and zf.shape == sf.shape
    assert frag_shape(qf) == (48, 256) and frag_shape(qw) == (48, 256)
    back = wna16_from_frag(qf, sf, zf)
    for got, want in zip(back, (qw, s, z), strict=True):
        assert_equal(got, want)
    values = reference.unpack_int32(qw, 4)  # [N, K]
    for b, st, g, c, hi, jj in ((0, 0, 0, 0, 0, 0), (2, 3, 7, 3, 1, 1), (1, 2, 5, 1, 0, 1)):
        word = int(qf[b, st, 4 * g + c, 2 * hi + jj]) & 0xFFFFFFFF
        row, first_k = 16 * b + g + 8 * hi, 8 * (8 * st + 2 * c + jj)
        for p in range(8):
            v = 2 * p if p < 4 else 2 * (p - 4) + 1
            assert (word >> (4 * p)) & 0xF == int(values[row, first_k + v])
        assert sf[b, 1, g, hi] == s[row, 1] and zf[b, 1, g, hi] == z[row, 1]


def test_frag_fits():
    assert frag_fits(4096, 4096, 128, 4, False) == []
    assert frag_fits(4096, 4096, 4096, 4, False) == []  # channel-wise
    assert len(frag_fits(4100, 4096, 32, 8, True)) == 4


@pytest.mark.parametrize("zeros", [False, True])
def test_frag_torch_backend_exact(zeros):
    """The torch backend undoes the layout: the rows layout's results, bit for bit."""
    qw, s, z, qf, sf, zf = _case(32, 192, 3, zeros, torch.float32, 5, "cpu")
    x = torch.randn(3, 192, generator=_gen(6))
    want = reference.wna16_linear(x, qw, s, z, None, 4, None)
    assert_equal(reference.wna16_linear(x, qf, sf, zf, None, 4, None), want)
    assert_equal(reference.dequantize_wna16(qf, sf, zf, None, 4, torch.float32),
                 reference.dequantize_wna16(qw, s, z, None, 4, torch.float32))  # fmt: skip


def test_frag_checks():
    from atom_kernels import wna16_linear

    qw, s, z, qf, sf, zf = _case(16, 128, 1, False, torch.float32, 7, "cpu")
    x = torch.randn(1, 128)
    with pytest.raises(ValueError, match="no g_idx"):
        wna16_linear(x, qf, sf, None, torch.zeros(128, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="4-bit"):
        wna16_linear(x, qf, sf, None, None, 8)
    with pytest.raises(ValueError, match="K = 64"):
        wna16_linear(torch.randn(1, 64), qf, sf, None, None, 4)
    with pytest.raises(ValueError, match="scales"):
        wna16_linear(x, qf, s, None, None, 4)  # rows-layout scales with fragment words


# (N, K, G, zeros, rows, dtype, config): groups of 64 / 128 / channel-wise, symmetric and not,
# 1-8 rows, splits (a last split shorter than the others; tile rows past it).
FRAG_CASES = [
    (32, 256, 2, False, 1, torch.bfloat16, None),
    (48, 512, 8, True, 3, torch.float16, None),
    (32, 640, 5, False, 8, torch.bfloat16, dict(SPLIT_K=3)),
    (16, 384, 1, True, 1, torch.bfloat16, dict(SPLIT_K=2)),
    (32, 320, 5, True, 6, torch.float16, dict(SPLIT_K=1)),
]


@pytest.mark.parametrize(("n", "k", "groups", "zeros", "rows", "dtype", "config"), FRAG_CASES)
def test_frag_linear(iq, triton_backend, n, k, groups, zeros, rows, dtype, config):
    device = triton_backend.device
    qw, s, z, qf, sf, zf = _case(n, k, groups, zeros, dtype, 11 + n + k, device)
    x = torch.randn(rows, k, generator=_gen(12)).to(dtype).to(device)
    bias = torch.randn(n, generator=_gen(13)).to(dtype).to(device)
    want = reference.wna16_linear(x, qw, s, z, None, 4, bias)
    atol, rtol = TOLERANCES[dtype]
    got = iq.wna16_linear(x, qf, sf, zf, None, 4, bias, config)
    assert_close(got, want, atol=atol, rtol=rtol, name=f"frag {rows} rows")


@pytest.mark.parametrize(("rows", "dtype"), [(1, torch.float32), (12, torch.bfloat16),
                                             (33, torch.float16), (2, torch.bfloat16)])  # fmt: skip
def test_frag_tiled(iq, triton_backend, rows, dtype):
    """The interleaved loop on the fragment layout: fp32 x at one row, more than 8 rows, and
    (``FRAG_TILED``) 2 rows; the dequantization bit for bit."""
    device = triton_backend.device
    qw, s, z, qf, sf, zf = _case(48, 384, 3, rows % 2 == 0, dtype, 21 + rows, device)
    x = torch.randn(rows, 384, generator=_gen(22)).to(dtype).to(device)
    want = reference.wna16_linear(x, qw, s, z, None, 4, None)
    atol, rtol = TOLERANCES[dtype]
    got = iq.wna16_linear(x, qf, sf, zf, None, 4, None, dict(FRAG_TILED=True))
    assert_close(got, want, atol=atol, rtol=rtol, name=f"tiled {rows} rows")
    assert_equal(iq.dequantize_wna16(qf, sf, zf, None, 4, dtype),
                 reference.dequantize_wna16(qw, s, z, None, 4, dtype))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8])
@pytest.mark.parametrize(("n", "k"), LLAMA3_8B)
def test_frag_linear_gpu_real_sizes(iq, triton_backend, rows, n, k):
    qw, s, z, qf, sf, zf = _case(n, k, k // 128, rows == 2, torch.bfloat16, 31, "cuda")
    x = torch.randn(rows, k, generator=_gen(32)).to(torch.bfloat16).cuda()
    want = reference.wna16_linear(x, qw, s, z, None, 4, None)
    got = iq.wna16_linear(x, qf, sf, zf, None, 4, None)
    assert_close(got, want, atol=3e-2, rtol=2e-2, name=f"frag {rows}x{n}x{k}")


FRAG_LAUNCHES = [dict(SPLIT_K=1), dict(SPLIT_K=7), dict(ROWS_PER_WARP=4),
                 dict(num_warps=8, ROWS_PER_WARP=1), dict(maxnreg=None),
                 dict(k_stages=3)]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("config", FRAG_LAUNCHES, ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_frag_linear_gpu_launches(iq, triton_backend, config, dtype):
    n, k = 4096, 14336
    qw, s, z, qf, sf, zf = _case(n, k, k // 128, True, dtype, 33, "cuda")
    x = torch.randn(1, k, generator=_gen(34)).to(dtype).cuda()
    x[0, ::53] *= 20
    want = reference.wna16_linear(x, qw, s, z, None, 4, None)
    atol, rtol = TOLERANCES[dtype]
    got = iq.wna16_linear(x, qf, sf, zf, None, 4, None, config)
    assert_close(got, want, atol=atol, rtol=rtol, name=str(config))


@pytest.mark.gpu
def test_frag_linear_gpu_chained_in_a_graph(iq, triton_backend):
    """Three fragment GEMMs chained in a CUDA graph (split-K counters reset by each launch's
    last program), replayed on new inputs: the reference's chain each replay."""
    k = 4096
    weights = [_case(k, k, k // 128, zeros, torch.bfloat16, 40 + i, "cuda")
               for i, zeros in enumerate((False, True, False))]  # fmt: skip
    staged = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
    x = torch.zeros_like(staged)

    def chain():
        x.copy_(staged)
        h = x
        for _, _, _, qf, sf, zf in weights:
            h = iq.wna16_linear(h, qf, sf, zf, None, 4, None)
        return h

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for seed in range(3):
        staged.copy_(torch.randn(1, k, generator=_gen(50 + seed)).to(torch.bfloat16))
        graph.replay()
        want = staged.clone()
        for qw, s, z, *_ in weights:
            want = reference.wna16_linear(want, qw, s, z, None, 4, None)
        assert_close(out, want, atol=6e-2, rtol=4e-2, name=f"replay {seed}")
