"""Rotary-embedding cos/sin caches (plain torch, built once per model, not dispatched).

The inverse frequencies follow transformers' ``modeling_rope_utils`` formula for formula (same
operations in the same order, so fp32 results match HF's), for the HF config's ``rope_scaling`` /
``rope_parameters`` dict. ``rotary_dim`` and ``base`` are given explicitly, so the dict's
``partial_rotary_factor`` and ``rope_theta`` are not read.
"""

from __future__ import annotations

import math

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "deepseek_yarn")


def _rope_type(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling: rope_type {rope_type!r} is not supported; expected one of "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return rope_type


def _require(rope_scaling: dict, key: str, rope_type: str):
    if rope_scaling.get(key) is None:
        raise ValueError(f"rope_scaling: rope_type {rope_type!r} needs {key!r}, got {rope_scaling}")
    return rope_scaling[key]


def _default_inv_freq(dim: int, base: float, device) -> torch.Tensor:
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim
    return 1.0 / (base**exponent)


def _llama3_inv_freq(dim: int, base: float, params: dict, max_position: int, device):
    inv_freq = _default_inv_freq(dim, base, device)
    factor = _require(params, "factor", "llama3")
    low_freq_factor = _require(params, "low_freq_factor", "llama3")
    high_freq_factor = _require(params, "high_freq_factor", "llama3")
    old_context_len = params.get("original_max_position_embeddings") or max_position

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    smoothed_inv_freq = (
        1 - smooth_factor
    ) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def _yarn_get_mscale(scale: float, mscale: float = 1) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(dim: int, base: float, params: dict, max_position: int, device):
    original_max = params.get("original_max_position_embeddings") or max_position
    factor = params.get("factor")
    if factor is None:  # DeepSeek-style configs: the ratio of the context lengths
        if not max_position:
            raise ValueError("rope_scaling: yarn without 'factor' needs max_position")
        factor = max_position / original_max
    attention_factor = params.get("attention_factor")
    mscale = params.get("mscale")
    mscale_all_dim = params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(
                _yarn_get_mscale(factor, mscale) / _yarn_get_mscale(factor, mscale_all_dim)
            )
        else:
            attention_factor = _yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1
    truncate = params.get("truncate", True)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp.to(device=device, dtype=torch.float)
    inv_freq = (
        inv_freq_interpolation * (1 - extrapolation_factor)
        + inv_freq_extrapolation * extrapolation_factor
    )
    return inv_freq, float(attention_factor)


def rope_inv_freq_and_attention_factor(
    rotary_dim: int,
    base: float,
    rope_scaling: dict | None = None,
    max_position: int | None = None,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (fp32) and the factor cos/sin are multiplied by.

    ``max_position`` stands in for the HF config's ``max_position_embeddings`` where a scaling
    type reads it (llama3/yarn ``original_max_position_embeddings`` default, yarn ``factor=None``).
    "dynamic" (NTK) is computed statically, as vLLM does: HF's formula evaluated at
    ``seq_len = max_position_embeddings * factor``, i.e.
    ``base' = base * (factor**2 - (factor - 1)) ** (d / (d - 2))`` for every position (HF instead
    grows the base at run time once a sequence passes max_position_embeddings).
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rope: rotary_dim must be a positive even number, got {rotary_dim}")
    rope_type = _rope_type(rope_scaling)
    params = rope_scaling or {}
    dim = rotary_dim
    attention_factor = 1.0
    if rope_type == "default":
        inv_freq = _default_inv_freq(dim, base, device)
    elif rope_type == "linear":
        inv_freq = _default_inv_freq(dim, base, device) / _require(params, "factor", rope_type)
    elif rope_type == "dynamic":
        factor = _require(params, "factor", rope_type)
        # HF: base * (factor * seq_len / max_pos - (factor - 1)) ** (dim / (dim - 2)), seq_len =
        # max_pos * factor.
        scaled_base = base * ((factor * factor) - (factor - 1)) ** (dim / (dim - 2))
        inv_freq = _default_inv_freq(dim, scaled_base, device)
    else:  # llama3, yarn, deepseek_yarn
        if max_position is None and params.get("original_max_position_embeddings") is None:
            raise ValueError(
                f"rope_scaling: rope_type {rope_type!r} needs 'original_max_position_embeddings' "
                "(or pass max_position)"
            )
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(dim, base, params, max_position or 0, device)
        else:
            inv_freq, attention_factor = _yarn_inv_freq(
                dim, base, params, max_position or 0, device
            )
    return inv_freq, attention_factor


def rope_cos_sin_cache(
    rotary_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The cos/sin cache [max_position, rotary_dim]: row p = [cos(p * f), sin(p * f)], f the
    rotary_dim // 2 inverse frequencies, both halves multiplied by the scaling's attention factor
    (yarn). Computed in fp32, returned in ``dtype``. Index it with positions in
    ``atom_kernels.rotary_embedding``.
    """
    if max_position <= 0:
        raise ValueError(f"rope_cos_sin_cache: max_position must be positive, got {max_position}")
    inv_freq, attention_factor = rope_inv_freq_and_attention_factor(
        rotary_dim, base, rope_scaling, max_position, device
    )
    positions = torch.arange(max_position, dtype=torch.float, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq[None, :]  # [P, R/2]
    cache = torch.cat((freqs.cos() * attention_factor, freqs.sin() * attention_factor), dim=-1)
    return cache.to(dtype)
