"""rope_cos_sin_cache against transformers' rotary embedding and rope init functions."""

import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import atom_kernels as ak
from atom_kernels.testing import assert_close, assert_equal

HEAD_DIM = 32
MAX_POS = 512
BASE = 10000.0

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.5},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn_deepseek": {
        "type": "yarn",  # legacy key
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 64,
    },
    "yarn_gpt_oss": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
        "truncate": False,
        "original_max_position_embeddings": 96,
    },
    "yarn_attention_factor": {
        "rope_type": "yarn",
        "factor": 2.0,
        "attention_factor": 0.9,
        "original_max_position_embeddings": 200,
    },
}


def _config(rope_scaling, partial_rotary_factor=None):
    params = {**(rope_scaling or {"rope_type": "default"}), "rope_theta": BASE}
    if partial_rotary_factor is not None:
        params["partial_rotary_factor"] = partial_rotary_factor
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=2,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POS,
        rope_parameters=params,
    )


@pytest.mark.parametrize("name", list(SCALINGS))
def test_cache_matches_hf_rotary_embedding(name):
    rope_scaling = SCALINGS[name]
    hf = LlamaRotaryEmbedding(_config(dict(rope_scaling) if rope_scaling else None))
    x = torch.randn(1, 4, HEAD_DIM)
    hf_cos, hf_sin = hf(x, torch.arange(MAX_POS)[None])  # [1, P, D], halves duplicated
    cache = ak.rope_cos_sin_cache(HEAD_DIM, MAX_POS, BASE, rope_scaling)
    assert cache.shape == (MAX_POS, HEAD_DIM) and cache.dtype == torch.float32
    half = HEAD_DIM // 2
    assert_equal(cache[:, :half], hf_cos[0, :, :half], name=f"{name} cos")
    assert_equal(cache[:, half:], hf_sin[0, :, :half], name=f"{name} sin")


@pytest.mark.parametrize("name", ["linear", "llama3", "yarn", "yarn_deepseek", "yarn_gpt_oss"])
def test_partial_rotary_inv_freq_matches_hf(name):
    rope_scaling = dict(SCALINGS[name])
    config = _config(dict(rope_scaling), partial_rotary_factor=0.5)
    rope_type = config.rope_parameters["rope_type"]
    hf_inv_freq, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    inv_freq, factor = ak.rope_inv_freq_and_attention_factor(
        HEAD_DIM // 2, BASE, rope_scaling, max_position=MAX_POS
    )
    assert_equal(inv_freq, hf_inv_freq, name=f"{name} inv_freq")
    assert factor == pytest.approx(hf_factor, rel=1e-12)


@pytest.mark.parametrize("factor", [2.0, 1.5, 4.0])
def test_dynamic_ntk_is_hf_at_max_position_times_factor(factor):
    rope_scaling = {"rope_type": "dynamic", "factor": factor}
    config = _config(dict(rope_scaling))
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, "cpu", seq_len=int(MAX_POS * factor))
    inv_freq, attention_factor = ak.rope_inv_freq_and_attention_factor(
        HEAD_DIM, BASE, rope_scaling, max_position=MAX_POS
    )
    assert attention_factor == 1.0
    assert_close(inv_freq, hf_inv_freq, atol=0, rtol=1e-6, name="dynamic inv_freq")


def test_default_cache_against_closed_form():
    # Independent of HF: cos/sin(p * base^(-2i/d)) in fp64.
    cache = ak.rope_cos_sin_cache(24, 300, 5000.0, dtype=torch.float64)
    p = torch.arange(300, dtype=torch.float64)[:, None]
    angle = p * 5000.0 ** (-torch.arange(0, 24, 2, dtype=torch.float64) / 24)
    assert_close(cache[:, :12], angle.cos(), atol=1e-4, rtol=0, name="cos")
    assert_close(cache[:, 12:], angle.sin(), atol=1e-4, rtol=0, name="sin")


def test_yarn_attention_factor_scales_cos_and_sin():
    rope_scaling = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64}
    _, factor = ak.rope_inv_freq_and_attention_factor(32, BASE, rope_scaling, max_position=1024)
    assert factor == pytest.approx(0.1 * math.log(16.0) + 1.0)
    cache = ak.rope_cos_sin_cache(32, 1024, BASE, rope_scaling)
    assert_close(cache[0, :16], torch.full((16,), factor), atol=1e-7, rtol=0, name="cos at 0")


def test_dtype_and_device_arguments():
    cache = ak.rope_cos_sin_cache(16, 40, BASE, dtype=torch.bfloat16, device="cpu")
    assert cache.dtype == torch.bfloat16
    assert_equal(cache, ak.rope_cos_sin_cache(16, 40, BASE).to(torch.bfloat16))


def test_bad_arguments():
    with pytest.raises(ValueError, match="rotary_dim"):
        ak.rope_cos_sin_cache(15, 10, BASE)
    with pytest.raises(ValueError, match="longrope"):
        ak.rope_cos_sin_cache(16, 10, BASE, {"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ValueError, match="'low_freq_factor'"):
        ak.rope_cos_sin_cache(16, 10, BASE, {"rope_type": "llama3", "factor": 8.0})
