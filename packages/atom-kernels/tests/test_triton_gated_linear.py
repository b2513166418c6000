"""Triton gate/up GEMM with SiLU-and-mul (the linear_silu_and_mul op's decode path) against the
torch reference (``linear`` then ``silu_and_mul``)."""

import pytest
import torch
import torch.nn.functional as F

from atom_kernels.backends.triton import gated_linear
from atom_kernels.backends.triton.linear import SkinnyConfig
from atom_kernels.registry import get_op
from atom_kernels.testing import assert_close

# (rows, N, K): one row and several; K a multiple of the tile and not; N not a multiple of BLOCK_N
SHAPES = [(1, 48, 64), (1, 37, 100), (3, 24, 96), (8, 20, 64), (5, 123, 123), (2, 3, 5)]
CONFIGS = [
    SkinnyConfig(16, 32, 4, 1),
    SkinnyConfig(8, 64, 4, 2),  # a dot: BLOCK_N 16
    SkinnyConfig(16, 32, 4, 1, False),
    SkinnyConfig(8, 16, 4, 1, False),
    # each W tile loaded one step ahead (one row, K a multiple of 32; else the plain loop)
    SkinnyConfig(16, 32, 4, 1, False, prefetch=True),
]
NORM_CONFIGS = [*CONFIGS[:3], CONFIGS[-1]]
TOLERANCES = {  # fp32 accumulation; the rounding of gate / up / out to the dtype dominates
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
    torch.float32: dict(atol=1e-5, rtol=1e-5),
}


def _inputs(rows, n, k, dtype, device, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n * 10 + k)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * n, k, generator=g) / k**0.5 * 2).to(dtype).to(device)
    b = torch.randn(2 * n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def _expected(x, w, b):
    """The reference's math in fp32: the GEMM rounded to x's dtype, then SiLU-and-mul."""
    gate_up = F.linear(x.float(), w.float(), None if b is None else b.float()).to(x.dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def _tolerance(dtype: torch.dtype, dots: bool) -> dict:
    """fp32 dots (more than one row, or a dot config) run in TF32 on a GPU (10-bit mantissa
    products); the interpreter computes them in fp32."""
    if dtype == torch.float32 and dots:
        return dict(atol=2e-2, rtol=1e-2)
    return TOLERANCES[dtype]


def _config_id(c: SkinnyConfig) -> str:
    return f"{c.block_n}x{c.block_k}-dot{c.use_dot}" + ("-ahead" if c.prefetch else "")


@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gated_skinny_linear(triton_backend, dtype, shape, bias, config):
    rows, n, k = shape
    tol = _tolerance(dtype, rows > 1 or config.use_dot)
    x, w, b = _inputs(rows, n, k, dtype, triton_backend.device, bias)
    out = gated_linear.gated_skinny_linear(x, w, b, config)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert_close(out.float(), _expected(x, w, b), **tol, name="gated_skinny_linear")


def test_gated_skinny_linear_leading_dims_and_strided_x(triton_backend):
    x, w, b = _inputs(4, 24, 40, torch.bfloat16, triton_backend.device, True)
    wide = torch.full((4, 56), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, 8:48] = x
    strided = wide[:, 8:48]  # rows 56 apart
    out = gated_linear.gated_skinny_linear(strided, w, b, CONFIGS[0])
    assert_close(out.float(), _expected(x, w, b), **TOLERANCES[torch.bfloat16])
    out3 = gated_linear.gated_skinny_linear(x.view(2, 2, 40), w, b, CONFIGS[1])
    assert out3.shape == (2, 2, 24)
    assert_close(out3.float().view(4, 24), _expected(x, w, b), **TOLERANCES[torch.bfloat16])


def test_gated_skinny_linear_default_config_and_empty_inputs(triton_backend):
    device = triton_backend.device
    x, w, b = _inputs(1, 40, 64, torch.bfloat16, device, True)
    out = gated_linear.gated_skinny_linear(x, w, b)
    assert_close(out.float(), _expected(x, w, b), **TOLERANCES[torch.bfloat16])
    assert gated_linear.gated_skinny_linear(x[:0], w, b).shape == (0, 40)
    no_k = gated_linear.gated_skinny_linear(x[:, :0], w[:, :0], b)
    assert_close(no_k.float(), _expected(x[:, :0], w[:, :0], b), **TOLERANCES[torch.bfloat16])


def test_registry_entry_matches_the_reference(triton_backend):
    # Interpreted, the entry takes the two-op path (`takes` is False on the CPU); compiled, one
    # row takes the fused kernel.
    x, w, b = _inputs(1, 37, 100, torch.bfloat16, triton_backend.device, True)
    out = get_op("linear_silu_and_mul", x.device)(x, w, b)
    assert_close(out.float(), _expected(x, w, b), **TOLERANCES[torch.bfloat16])


def test_where_the_fused_kernel_runs(monkeypatch):
    monkeypatch.setattr(gated_linear, "ENABLED", True)  # whatever ATOM_FUSED_GATE_UP says

    # meta tensors: the policy on a 4-SM "device" without running anything
    def takes(rows, n2, k, dtype=torch.bfloat16):
        x = torch.empty(rows, k, dtype=dtype, device="meta")
        return gated_linear.takes(x, torch.empty(n2, k, dtype=dtype, device="meta"))

    assert takes(1, 6144, 1024)  # small weights too: Triton matched cuBLAS on them
    assert takes(8, 6144, 1024)
    assert takes(4, 28672, 4096)
    assert not takes(1, 6144, 1024, torch.float32)  # fp32 keeps cuBLAS (tests' precision)
    assert not takes(9, 28672, 4096)  # past SKINNY_MAX_ROWS: the GEMM is no weight stream
    assert not takes(0, 6144, 1024)


def _expected_norm(x, residual, norm_weight, eps, w, b):
    """fused_add_rms_norm's roundings (the torch reference), then _expected."""
    new_residual = (x.float() + residual.float()).to(x.dtype)
    s = new_residual.float()
    normed = (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    normed = (norm_weight.float() * normed.float()).to(x.dtype)
    return _expected(normed, w, b), new_residual


@pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("config", NORM_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("shape", [(1, 48, 64), (1, 37, 100), (3, 24, 96), (5, 123, 123)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_gated_skinny_linear(triton_backend, monkeypatch, dtype, shape, config, one_pass):
    # one_pass (ATOM_NORM_ONE_PASS): one row without dots takes the statistics in the GEMM's loop
    monkeypatch.setattr(gated_linear, "NORM_ONE_PASS", one_pass)
    rows, n, k = shape
    tol = _tolerance(dtype, rows > 1 or config.use_dot)
    x, w, b = _inputs(rows, n, k, dtype, triton_backend.device, True)
    g = torch.Generator().manual_seed(k)
    residual = torch.randn(rows, k, generator=g).to(dtype).to(x.device)
    norm_weight = (1 + torch.randn(k, generator=g) / 4).to(dtype).to(x.device)
    out, new_residual = gated_linear.norm_gated_skinny_linear(
        x, residual, norm_weight, 1e-6, w, b, config
    )
    expected, expected_residual = _expected_norm(x, residual, norm_weight, 1e-6, w, b)
    assert out.shape == (rows, n) and new_residual.shape == (rows, k)
    assert torch.equal(new_residual, expected_residual)  # one rounding of the same sum
    assert_close(out.float(), expected, **tol, name="norm_gated_skinny_linear")


def test_norm_registry_entry_matches_the_reference(triton_backend):
    x, w, b = _inputs(1, 37, 100, torch.bfloat16, triton_backend.device, False)
    residual, norm_weight = torch.randn_like(x), torch.rand(100, device=x.device).to(x.dtype)
    op = get_op("fused_add_rms_norm_linear_silu_and_mul", x.device)
    out, new_residual = op(x, residual, norm_weight, 1e-5, w, b)
    expected, expected_residual = _expected_norm(x, residual, norm_weight, 1e-5, w, b)
    assert torch.equal(new_residual, expected_residual)
    assert_close(out.float(), expected, **TOLERANCES[torch.bfloat16])


def test_where_the_fused_norm_runs(monkeypatch):
    monkeypatch.setattr(gated_linear, "ENABLED", True)
    monkeypatch.setattr(gated_linear, "NORM_ENABLED", True)

    def takes(rows, dtype=torch.bfloat16, k=1024):
        x = torch.empty(rows, k, dtype=dtype, device="meta")
        return gated_linear.takes_norm(x, torch.empty(6144, k, dtype=dtype, device="meta"))

    assert takes(1)
    assert not takes(2)  # more rows: the norm's own kernel (each program would reread them)
    assert not takes(1, torch.float32)
    assert not takes(1, k=4096)  # wide rows: measured slower (Llama-3-8B)


@pytest.mark.parametrize("one_pass", [False, True], ids=["two_pass", "one_pass"])
@pytest.mark.parametrize("has_residual", [True, False])
@pytest.mark.parametrize("config", NORM_CONFIGS, ids=_config_id)
@pytest.mark.parametrize("shape", [(1, 48, 64), (1, 37, 100), (3, 24, 96), (5, 123, 123)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_skinny_linear(
    triton_backend, monkeypatch, dtype, shape, config, has_residual, one_pass
):
    monkeypatch.setattr(gated_linear, "NORM_ONE_PASS", one_pass)
    rows, n, k = shape
    tol = _tolerance(dtype, rows > 1 or config.use_dot)
    x, w, b = _inputs(rows, n, k, dtype, triton_backend.device, True)
    w, b = w[:n], b[:n]  # one W stream: [N, K]
    g = torch.Generator().manual_seed(k)
    residual = torch.randn(rows, k, generator=g).to(dtype).to(x.device) if has_residual else None
    norm_weight = (1 + torch.randn(k, generator=g) / 4).to(dtype).to(x.device)
    out, new_residual = gated_linear.norm_skinny_linear(
        x, residual, norm_weight, 1e-6, w, b, config
    )
    s = x if residual is None else (x.float() + residual.float()).to(dtype)
    normed = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    normed = (norm_weight.float() * normed.float()).to(dtype)
    expected = F.linear(normed.float(), w.float(), b.float())
    assert out.shape == (rows, n) and torch.equal(new_residual, s)
    assert_close(out.float(), expected, **tol, name="norm_skinny_linear")


def test_norm_linear_registry_entry_matches_the_reference(triton_backend):
    x, w, _ = _inputs(1, 37, 100, torch.bfloat16, triton_backend.device, False)
    norm_weight = torch.rand(100, device=x.device).to(x.dtype)
    op = get_op("rms_norm_linear", x.device)
    out, residual = op(x, None, norm_weight, 1e-5, w, None)
    assert residual is x or torch.equal(residual, x)
    normed = get_op("rms_norm", x.device)(x, norm_weight, 1e-5)
    assert_close(out.float(), F.linear(normed.float(), w.float()), **TOLERANCES[torch.bfloat16])


def test_where_the_fused_norm_linear_runs(monkeypatch):
    monkeypatch.setattr(gated_linear, "NORM_LINEAR_ENABLED", True)

    def takes(rows, dtype=torch.bfloat16, k=1024):
        x = torch.empty(rows, k, dtype=dtype, device="meta")
        return gated_linear.takes_norm_linear(x, torch.empty(4096, k, device="meta"))

    assert takes(1) and not takes(2) and not takes(1, torch.float32)
    monkeypatch.setattr(gated_linear, "NORM_ONE_PASS_LINEAR", True)  # the default
    assert takes(1, k=4096) and not takes(1, k=8192)  # NORM_LINEAR_MAX_FEATURES
    monkeypatch.setattr(gated_linear, "NORM_ONE_PASS_LINEAR", False)
    assert not takes(1, k=4096)  # two passes: measured slower at Llama-3-8B's width


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("has_residual", [True, False])
def test_norm_skinny_linear_gpu_real_sizes(triton_backend, monkeypatch, has_residual, prefetch):
    # Llama-3-8B's input norm + QKV (6144 x 4096) at one row with the default tiles and the
    # one-pass norm (W tiles loaded ahead through ATOM_SKINNY_ONE_ROW's prefetch, or not),
    # against rms_norm then linear.
    from atom_kernels.backends.triton import linear

    tile = linear._one_row_override("4,1024,4,1,1") if prefetch else None
    monkeypatch.setattr(linear, "ONE_ROW_OVERRIDE", tile)
    monkeypatch.setattr(gated_linear, "NORM_ONE_PASS_LINEAR", True)
    rows, n, k = 1, 6144, 4096
    x, w, _ = _inputs(rows, n, k, torch.bfloat16, "cuda", False)
    w = w[:n]
    g = torch.Generator().manual_seed(k)
    residual = torch.randn(rows, k, generator=g).to(torch.bfloat16).cuda() if has_residual else None
    norm_weight = (1 + torch.randn(k, generator=g) / 4).to(torch.bfloat16).cuda()
    out, new_residual = gated_linear.norm_skinny_linear(x, residual, norm_weight, 1e-5, w, None)
    s = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    normed = (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    normed = (norm_weight.float() * normed.float()).to(x.dtype)
    assert torch.equal(new_residual, s)
    assert_close(out.float(), F.linear(normed.float(), w.float()), **TOLERANCES[torch.bfloat16])
