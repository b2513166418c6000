"""fused_moe with WNA16 experts (quant="wna16": 4- or 8-bit integers packed in int32) against the
torch reference: both paths (per-pair for one token, sorted), symmetric and asymmetric, group 32,
64 and channel-wise scales, K steps inside one group and across groups, -1 slots (expert
parallelism), biases with GPT-OSS's activation, each float dtype, strided operands, the custom
op's pass-through of the zeros, and on a GPU the Kimi-K2 expert shape."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.backends.torch import moe as moe_reference
from atom_kernels.testing import assert_close, strided_copy

# (atol, rtol): both sides multiply the same dequantized weights (computed the same way, one
# rounding); summation order differs.
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def _randn(*shape, seed, device, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(device)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., K] unsigned values -> int32 [..., K * bits / 32], lowest bits first."""
    per_int = 32 // bits
    grouped = values.long().reshape(*values.shape[:-1], -1, per_int)
    shifts = torch.arange(per_int, dtype=torch.long) * bits
    words = (grouped << shifts).sum(dim=-1) & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _weight(num_experts, rows, k, bits, groups, asym, dtype, device, seed):
    """(qweight, scales, zeros or None) of random integers with scales giving outputs of about
    unit variance (values centred on the zero point)."""
    g = torch.Generator().manual_seed(seed)
    # Random words: every value 0 .. 2**bits - 1 equally likely (4 bytes a word even at real
    # sizes: Kimi-K2's 32 experts are 0.5 GB of words).
    words = torch.randint(-(2**31), 2**31, (num_experts, rows, k * bits // 32), generator=g,
                          dtype=torch.int32)  # fmt: skip
    zeros = None
    if asym:
        zeros = torch.randint(0, 2**bits, (num_experts, rows, groups), generator=g).to(dtype)
    spread = 2 ** (bits - 1) / 3**0.5  # std of a uniform value around the zero point
    scales = (torch.rand(num_experts, rows, groups, generator=g) + 0.5) / (spread * k**0.5)
    return (
        words.to(device),
        scales.to(dtype).to(device),
        None if zeros is None else zeros.to(device),
    )


def _experts(num_experts, hidden, inter, bits, groups13, groups2, asym, dtype, device, seed):
    w13 = _weight(num_experts, 2 * inter, hidden, bits, groups13, asym, dtype, device, seed)
    w2 = _weight(num_experts, hidden, inter, bits, groups2, asym, dtype, device, seed + 1)
    return w13, w2


def _routing(num_tokens, num_experts, top_k, seed, device, drop=None):
    logits = _randn(num_tokens, num_experts, seed=seed, device=device)
    weights, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    ids = ids.int()
    if drop is not None:  # expert parallelism: experts >= drop belong to another rank
        ids = torch.where(ids < drop, ids, -1)
    return weights, ids


def _check(x, experts, routing, config=None, oai=False, atol=None, op=None, name=""):
    from atom_kernels.backends.triton import moe

    (q13, s13, z13), (q2, s2, z2) = experts
    weights, ids = routing
    num_experts = q13.shape[0]
    b13 = b2 = None
    if oai:
        b13 = _randn(num_experts, q13.shape[1], seed=90, device=x.device).to(x.dtype)
        b2 = _randn(num_experts, q2.shape[1], seed=91, device=x.device).to(x.dtype)
    activation = "swiglu_oai" if oai else "silu"
    args = (x, q13, q2, weights, ids, activation, b13, b2, oai, 1.702, 7.0)
    qargs = dict(quant="wna16", w13_scale=s13, w2_scale=s2, w13_zeros=z13, w2_zeros=z2)
    if op is None:
        out = moe.fused_moe(*args, config=config, **qargs)
    else:
        out = op(*args, **qargs)
    expected = moe_reference.fused_moe(*args, **qargs)
    tol_a, tol_r = TOLERANCES[x.dtype]
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert_close(out, expected, atol=atol or tol_a, rtol=atol or tol_r,
                 name=f"fused_moe(wna16 {name}, T={x.shape[0]})")  # fmt: skip


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("asym", [False, True])
@pytest.mark.parametrize("group", [32, 0])  # 0: channel-wise
@pytest.mark.parametrize("num_tokens", [1, 5])  # per-pair, sorted
def test_fused_moe_wna16(triton_backend, bits, asym, group, num_tokens):
    device, hidden, inter = triton_backend.device, 64, 32
    g13, g2 = (hidden // group, inter // group) if group else (1, 1)
    experts = _experts(4, hidden, inter, bits, g13, g2, asym, torch.bfloat16, device, seed=10)
    x = _randn(num_tokens, hidden, seed=11, device=device).to(torch.bfloat16)
    _check(x, experts, _routing(num_tokens, 4, 2, 12, device), name=f"int{bits} g{group}")


@pytest.mark.parametrize("num_tokens", [1, 6])
def test_fused_moe_wna16_minus_one_slots(triton_backend, num_tokens):
    """Experts 3.. belong to another rank: their slots are -1 (some tokens lose every slot);
    their weights are poisoned (NaN scales), so reading one would show."""
    device, hidden, inter = triton_backend.device, 64, 32
    experts = _experts(6, hidden, inter, 4, 2, 1, True, torch.bfloat16, device, seed=20)
    for _, scales, _ in experts:
        scales[3:] = float("nan")
    x = _randn(num_tokens, hidden, seed=21, device=device).to(torch.bfloat16)
    weights, ids = _routing(num_tokens, 6, 3, 22, device, drop=3)
    ids[0] = -1  # a token with nothing computed here: a zero row
    _check(x, experts, (weights, ids), name="-1 slots")


@pytest.mark.parametrize("per_pair", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fused_moe_wna16_biases_dtypes(triton_backend, per_pair, dtype):
    """GPT-OSS's activation (swiglu_oai, interleaved gate/up, biases) in fp16 and fp32."""
    device, hidden, inter = triton_backend.device, 32, 32
    experts = _experts(3, hidden, inter, 8, 1, 1, True, dtype, device, seed=30)
    num_tokens = 1 if per_pair else 4
    x = _randn(num_tokens, hidden, seed=31, device=device).to(dtype)
    _check(x, experts, _routing(num_tokens, 3, 2, 32, device), oai=True, name="oai")


# (bits, BLOCK_K, w13's group size, w2's): BLOCK_K / (32 / bits) >= 16 runs the split loop, else
# the gathered tile; a group size that BLOCK_K divides gives vector scales, else gathered ones.
TILE_CASES = [
    (4, 32, 64, 32),  # tile, vector scales
    (4, 64, 32, 96),  # tile, gathered scales (w2 channel-wise: 96 inputs, 64-input steps)
    (4, 128, 128, 32),  # split: vector scales; gathered ones and a partial last step (I = 96)
    (4, 128, 256, 96),  # split, channel-wise
    (8, 64, 64, 32),  # split at 8 bits
    (8, 32, 256, 96),  # tile at 8 bits, channel-wise
]


@pytest.mark.parametrize(("bits", "block_k", "group13", "group2"), TILE_CASES)
@pytest.mark.parametrize("strided", [False, True])
def test_fused_moe_wna16_tiles(triton_backend, bits, block_k, group13, group2, strided):
    """Both K loops and both scale loads: H = 256 and I = 96 over 64-column tiles (a partial
    column tile); 20 pairs of one expert (two 16-row blocks); strided activations, packed
    weights, scales and zeros, or contiguous ones."""
    device, hidden, inter = triton_backend.device, 256, 96
    g13, g2 = hidden // group13, inter // group2
    experts = _experts(2, hidden, inter, bits, g13, g2, True, torch.bfloat16, device, seed=40)
    x = _randn(10, hidden, seed=41, device=device).to(torch.bfloat16)
    if strided:
        experts = tuple(tuple(strided_copy(t) for t in w) for w in experts)
        x = strided_copy(x)
    cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, num_warps=4, GROUP_M=2)
    config = {"per_pair": False, "gemm1": cfg, "gemm2": cfg}
    _check(x, experts, _routing(10, 2, 2, 42, device), config=config, name=f"K{block_k}")


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize(("bits", "block_k", "group13", "group2"), TILE_CASES[2:5])
def test_fused_moe_wna16_split_forced(triton_backend, split, bits, block_k, group13, group2):
    """``SPLIT`` in a GEMM's config picks the K loop at a tile where both run: the split one (no
    interleave, the default there) or the tile one; both meet the reference."""
    device, hidden, inter = triton_backend.device, 256, 96
    experts = _experts(2, hidden, inter, bits, hidden // group13, inter // group2, True,
                       torch.float16, device, seed=48)  # fmt: skip
    x = _randn(10, hidden, seed=49, device=device).to(torch.float16)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, num_warps=4, SPLIT=split)
    config = {"per_pair": False, "gemm1": cfg, "gemm2": cfg}
    _check(x, experts, _routing(10, 2, 2, 50, device), config=config, name=f"SPLIT={split}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("asym", "group13", "group2"), [(False, 32, 32), (True, 128, 0)])
def test_fused_moe_wna16_packed(triton_backend, dtype, asym, group13, group2):
    """``PACKED`` (the split loop's packed unpack, ``int_quant_packed_dot.unpack_scaled``; the
    interpreter takes its shift-and-mask form): the reference's dequantized experts, group 32
    (scales gathered a word) and 128 / channel-wise (a scale vector a step), zero points."""
    device, hidden, inter = triton_backend.device, 256, 128
    g13, g2 = hidden // group13, (inter // group2 if group2 else 1)
    experts = _experts(3, hidden, inter, 4, g13, g2, asym, dtype, device, seed=51)
    x = _randn(6, hidden, seed=52, device=device).to(dtype)
    cfg = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=128, num_warps=4, PACKED=True)
    config = {"per_pair": False, "gemm1": cfg, "gemm2": cfg}
    _check(x, experts, _routing(6, 3, 2, 53, device), config=config, name="PACKED")


def test_fused_moe_wna16_packed_refused_where_impossible(triton_backend):
    from atom_kernels.backends.triton import moe_wna16

    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128, PACKED=True)
    with pytest.raises(ValueError, match="PACKED"):  # 8-bit
        moe_wna16._launch(dict(cfg, BLOCK_K=256), 1, 256, 32, 8, x=x)
    with pytest.raises(ValueError, match="PACKED"):  # fp32 activations
        moe_wna16._launch(cfg, 1, 256, 32, 4, x=x.float())
    with pytest.raises(ValueError, match="PACKED"):  # the tile loop
        moe_wna16._launch(dict(cfg, SPLIT=False), 1, 256, 32, 4, x=x)


def test_fused_moe_wna16_split_refused_where_impossible(triton_backend):
    from atom_kernels.backends.triton import moe_wna16

    with pytest.raises(ValueError, match="SPLIT"):  # 32 inputs at 4 bits: a 4-deep dot
        moe_wna16._launch(dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SPLIT=True), 1, 256, 32, 4)


@pytest.mark.parametrize("row_fma", [False, True])
@pytest.mark.parametrize(
    ("bits", "block_k", "group", "dtype"),
    [(4, 128, 32, torch.bfloat16), (8, 64, 0, torch.float32), (4, 32, 64, torch.float16)],
)
def test_fused_moe_wna16_per_pair_loops(triton_backend, row_fma, bits, block_k, group, dtype):
    """One token (the per-pair path): the 16-row MMA (split or tile loop) and the register loop
    (``wna16_row``), over K = 256 / 96 (a partial last step), -1 slots included; float32 for
    8 bits (an off-by-one zero point moves an 8-bit weight by ~1%: inside bf16's tolerance)."""
    device, hidden, inter = triton_backend.device, 256, 96
    g13, g2 = (hidden // group, inter // group) if group and inter % group == 0 else (1, 1)
    experts = _experts(4, hidden, inter, bits, g13, g2, True, dtype, device, seed=43)
    x = _randn(1, hidden, seed=44, device=device).to(dtype)
    cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=block_k, num_warps=4)
    config = {"per_pair": True, "row_fma": row_fma, "gemm1": cfg, "gemm2": cfg}
    routing = _routing(1, 4, 3, 45, device, drop=3)
    _check(x, experts, routing, config=config, name=f"per-pair row_fma={row_fma}")


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_fused_moe_wna16_decode_config(triton_backend, monkeypatch, num_tokens):
    """The GPU's decode tiles (``wna16_configs`` on a GPU: 16 rows, 256-input split steps at 4
    bits) on Kimi-K2's format (int4, symmetric, group 32), with -1 slots."""
    from atom_kernels.backends.triton import moe_wna16

    device, hidden, inter = triton_backend.device, 256, 64
    if device != "cuda":
        monkeypatch.setattr(moe_wna16, "num_sms", lambda device: 132)  # an H100's
    config = moe_wna16.wna16_configs(num_tokens, 4, 8, hidden, inter, 4, torch.device("cuda"))
    if device == "cuda":
        config = None  # the same, chosen by the op
    else:
        assert config["per_pair"] == (num_tokens == 1)
        assert config["gemm1"]["BLOCK_K"] == config["gemm2"]["BLOCK_K"] == 256
    experts = _experts(8, hidden, inter, 4, hidden // 32, inter // 32, False, torch.bfloat16,
                       device, seed=45)  # fmt: skip
    x = _randn(num_tokens, hidden, seed=46, device=device).to(torch.bfloat16)
    routing = _routing(num_tokens, 8, 4, 47, device, drop=6)
    _check(x, experts, routing, config=config, name="decode tiles")


def test_fused_moe_wna16_custom_op_passes_zeros(triton_backend):
    """The torch custom op (what torch.compile graphs call) forwards w13_zeros / w2_zeros: with
    them dropped the weights would be the symmetric ones, far from the reference."""
    device = triton_backend.device
    experts = _experts(3, 32, 32, 4, 1, 1, True, torch.bfloat16, device, seed=50)
    x = _randn(3, 32, seed=51, device=device).to(torch.bfloat16)
    op = triton_backend.custom_ops.fused_moe
    routing = _routing(3, 3, 2, 52, device)
    _check(x, experts, routing, op=op, name="custom op")
    (q13, s13, z13), (q2, s2, z2) = experts
    args = (x, q13, q2, *routing, "silu", None, None, False, 1.702, 7.0, "wna16", s13, s2, None,
            z13, z2)  # fmt: skip
    torch.library.opcheck(torch.ops.atom.triton_fused_moe, args,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip


def test_pack_int32_layout():
    """The test's packer writes the documented layout (lowest bits first), as the reference
    unpacks it."""
    from atom_kernels.backends.torch.int_quant import unpack_int32

    values = torch.randint(0, 16, (3, 64), generator=torch.Generator().manual_seed(0))
    assert torch.equal(unpack_int32(pack_int32(values, 4), 4), values.int())
    assert pack_int32(torch.tensor([[1, 2, 0, 0, 0, 0, 0, 15]]), 4).item() == 0xF0000021 - 2**32


# --- real layer widths on a GPU -------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 4, 16, 64, 300])
@pytest.mark.parametrize(
    ("shape", "bits", "group", "asym"),
    [((32, 8, 7168, 2048), 4, 32, False),  # Kimi-K2-Thinking's experts (32 of them)
     ((16, 8, 7168, 2048), 8, 0, True),  # 8-bit asymmetric, channel-wise
     ((16, 4, 2048, 768), 4, 128, True)],  # Qwen3-30B-A3B width, GPTQ-style
)  # fmt: skip
def test_fused_moe_wna16_gpu_real_sizes(triton_backend, num_tokens, shape, bits, group, asym):
    num_experts, top_k, hidden, inter = shape
    g13, g2 = (hidden // group, inter // group) if group else (1, 1)
    experts = _experts(num_experts, hidden, inter, bits, g13, g2, asym, torch.bfloat16, "cuda",
                       seed=60)  # fmt: skip
    x = _randn(num_tokens, hidden, seed=61, device="cuda").to(torch.bfloat16)
    routing = _routing(num_tokens, num_experts, top_k, 62, "cuda", drop=num_experts * 3 // 4)
    _check(x, experts, routing, atol=5e-2, name=f"int{bits} g{group}")


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [4, 16, 64])
@pytest.mark.parametrize(("group", "asym"), [(32, False), (128, True)])
def test_fused_moe_wna16_gpu_packed(triton_backend, num_tokens, group, asym):
    """PACKED's PTX at Kimi-K2-Thinking's expert shape (32 of 384 experts, group 32) and a
    group-128 asymmetric one, the decode tiles (``wna16_configs``) with the packed unpack."""
    from atom_kernels.backends.triton import moe_wna16

    num_experts, top_k, hidden, inter = 32, 8, 7168, 2048
    experts = _experts(num_experts, hidden, inter, 4, hidden // group, inter // group, asym,
                       torch.bfloat16, "cuda", seed=63)  # fmt: skip
    x = _randn(num_tokens, hidden, seed=64, device="cuda").to(torch.bfloat16)
    routing = _routing(num_tokens, num_experts, top_k, 65, "cuda")
    config = moe_wna16.wna16_configs(num_tokens, top_k, num_experts, hidden, inter, 4,
                                     torch.device("cuda"))  # fmt: skip
    config = dict(config, gemm1=dict(config["gemm1"], PACKED=True),
                  gemm2=dict(config["gemm2"], PACKED=True))  # fmt: skip
    _check(x, experts, routing, config=config, atol=5e-2, name=f"PACKED g{group}")
