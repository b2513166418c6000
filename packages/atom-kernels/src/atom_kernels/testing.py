"""Helpers for kernel tests (this package's, its backends', the models'): comparisons
that print the first mismatches, per-dtype tolerances, strided copies of inputs."""

from __future__ import annotations

import torch

# Default (atol, rtol) per dtype for an op against an fp64/fp32 reference; ops with long reductions
# (attention) pass their own.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(atol, rtol) for results in ``dtype``."""
    return TOLERANCES[dtype]


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    atol: float,
    rtol: float,
    name: str = "tensor",
    max_report: int = 8,
    equal_nan: bool = False,
) -> None:
    """Assert |actual - expected| <= atol + rtol * |expected| elementwise (compared in fp64).

    On failure the message lists the first ``max_report`` mismatching indices with both values,
    the count of mismatches and the largest absolute error.
    """
    if tuple(actual.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{name}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
        )
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if bool(close.all()):
        return
    bad = (~close).nonzero()
    lines = [
        f"{name}: {bad.shape[0]} of {a.numel()} elements differ (atol={atol}, rtol={rtol}); "
        f"max abs err {(a - e).abs().nan_to_num(float('inf')).max().item():.3g}; first ones:"
    ]
    for idx in bad[:max_report].tolist():
        i = tuple(idx)
        lines.append(f"  at {i}: got {a[i].item()!r}, expected {e[i].item()!r}")
    raise AssertionError("\n".join(lines))


def assert_equal(actual: torch.Tensor, expected: torch.Tensor, *, name: str = "tensor") -> None:
    """Exact equality (NaN == NaN), with the first mismatches listed on failure."""
    if actual.dtype.is_floating_point or expected.dtype.is_floating_point:
        assert_close(actual, expected, atol=0.0, rtol=0.0, name=name, equal_nan=True)
        return
    if tuple(actual.shape) != tuple(expected.shape) or not torch.equal(
        actual.cpu(), expected.cpu()
    ):
        assert_close(actual.double(), expected.double(), atol=0.0, rtol=0.0, name=name)


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding the same values as ``t`` (every other element of a buffer
    twice as wide in the last dim)."""
    buf = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    buf.normal_() if t.dtype.is_floating_point else buf.zero_()
    view = buf[..., ::2]
    view.copy_(t)
    assert not view.is_contiguous() or t.numel() <= 1
    return view


def transposed_copy(t: torch.Tensor) -> torch.Tensor:
    """A non-contiguous view holding ``t``'s values: stored with its first two dims swapped."""
    if t.dim() < 2:
        return strided_copy(t)
    return t.transpose(0, 1).contiguous().transpose(0, 1)


# --- quantized weights (kernel and model tests quantize random weights with these) ------------

_E2M1_POSITIVE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def quantize_fp8_block(
    weight: torch.Tensor, block_size: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float -> (float8_e4m3fn [..., N, K], float32 weight_scale_inv
    [..., ceil(N / bn), ceil(K / bk)]): each block scaled so its max |w| maps to 448 (edge blocks
    may be partial)."""
    bn, bk = block_size
    *lead, n, k = weight.shape
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.nn.functional.pad(weight.float(), (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.view(*lead, rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0  # [..., rows, cols]
    q = (blocks / scale[..., :, None, :, None]).clamp(-448.0, 448.0)
    q = q.view(*lead, rows * bn, cols * bk)[..., :n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def quantize_fp8_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float -> (float8_e4m3fn [..., N, K], float32 scale [..., N]) per row."""
    scale = weight.float().abs().amax(dim=-1).clamp(min=1e-12) / 448.0
    q = (weight.float() / scale[..., None]).clamp(-448.0, 448.0)
    return q.to(torch.float8_e4m3fn), scale


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] float (K a multiple of 32) -> (uint8 [..., N, K / 2], two e2m1 codes a
    byte, low nibble first; uint8 e8m0 scales [..., N, K / 32]): each block of 32 scaled by the
    smallest power of two that brings its max |w| to <= 6, values rounded to the nearest e2m1."""
    *lead, n, k = weight.shape
    groups = weight.float().reshape(*lead, n, k // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # [..., N, G]
    scaled = groups / torch.exp2(exponent)[..., None]
    grid = torch.tensor(_E2M1_POSITIVE, device=weight.device)
    codes = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)  # nearest magnitude, 0..7
    codes = (codes + 8 * (scaled < 0)).to(torch.uint8).view(*lead, n, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), (exponent + 127).to(torch.uint8)
