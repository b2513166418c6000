"""Every architecture against transformers' own implementation on the same random weights
(float32), through the paged KV cache: dense Llama / Qwen3 shapes and the four MoE families."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from atom_models import load_model

BASE = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)

CONFIGS = {
    "llama-gqa-untied": lambda: LlamaConfig(
        **BASE, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False
    ),
    "llama-mha-tied-bias": lambda: LlamaConfig(
        **BASE,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
    ),
    "llama3-rope-scaling-mqa": lambda: LlamaConfig(
        **BASE,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen3-head-dim-32": lambda: Qwen3Config(
        **BASE,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    ),
    "qwen3-untied-bias": lambda: Qwen3Config(
        **BASE,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
}

MOE_BASE = dict(
    vocab_size=211,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)

MOE_CONFIGS = {
    # Layer 0 dense (mlp_only_layers), layer 1 sparse; renormalized top-2 of 8.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **MOE_BASE,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    # A sliding window shorter than the longer prompts, on every layer.
    "mixtral": lambda: MixtralConfig(
        **MOE_BASE,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
    ),
    # Layer 0 dense, layer 1: 8 experts in 4 groups (best 2 kept), top-3, scaled weights, shared
    # expert; q/k norm; attention bias; rotary on half of each head.
    "glm4_moe": lambda: Glm4MoeConfig(
        **MOE_BASE,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
    # Layer 0 sliding (window 8), layer 1 full; sinks; YaRN; biased router; clamped SwiGLU.
    "gpt_oss": lambda: GptOssConfig(
        **MOE_BASE,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
}

CONFIGS.update(MOE_CONFIGS)

PROMPT_LENGTHS = [7, 23, 1, 12, 40]


def prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    diff = (actual - expected).abs()
    if diff.max() > atol:
        worst = diff.flatten().topk(min(5, diff.numel()))
        raise AssertionError(
            f"{what}: max abs diff {diff.max():.3e} > {atol:.0e}; worst at flat indices "
            f"{worst.indices.tolist()}: got {actual.flatten()[worst.indices].tolist()}, "
            f"expected {expected.flatten()[worst.indices].tolist()}"
        )


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0]  # [n, V]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, make_checkpoint):
    path, hf = make_checkpoint(CONFIGS[request.param]())
    return request.param, load_model(path, dtype=torch.float32), hf


def test_architecture_is_registered(pair):
    name, model, hf = pair
    assert type(model).__name__ == hf.config.architectures[0]


def test_last_position_logits_match_transformers(pair, paged_session):
    name, model, hf = pair
    batch = prompts(hf.config.vocab_size)
    out = paged_session(model).step(dict(enumerate(batch)))  # every prompt in one mixed step
    for i, tokens in enumerate(batch):
        assert_close(out[i][-1], hf_logits(hf, tokens)[-1], 1e-4, f"{name} prompt {i}")


def test_paged_decode_matches_full_forward(pair, paged_session):
    """Prefill, then chunked prefill over a cached prefix, then one token at a time: every step's
    logits equal a full forward over the whole sequence (ATOM's own and transformers')."""
    name, model, hf = pair
    batch = prompts(hf.config.vocab_size, seed=2)
    full = paged_session(model, seed=5).step(dict(enumerate(batch)))
    session = paged_session(model, seed=7)
    cut = {i: max(1, len(t) // 3) for i, t in enumerate(batch)}
    session.step({i: t[: cut[i]] for i, t in enumerate(batch)})
    cut2 = {i: max(cut[i], (2 * len(t)) // 3) for i, t in enumerate(batch)}
    chunk = {i: t[cut[i] : cut2[i]] for i, t in enumerate(batch) if cut2[i] > cut[i]}
    got = session.step(chunk)
    for i in chunk:
        assert_close(got[i], full[i][cut[i] : cut2[i]], 1e-4, f"{name} seq {i} chunked prefill")
    # Decode the rest one token per step, all unfinished sequences batched together.
    position = dict(cut2)
    while any(position[i] < len(t) for i, t in enumerate(batch)):
        step = {i: [t[position[i]]] for i, t in enumerate(batch) if position[i] < len(t)}
        got = session.step(step)
        for i in step:
            assert_close(got[i][0], full[i][position[i]], 1e-4, f"{name} seq {i} decode")
            position[i] += 1
    for i, tokens in enumerate(batch):
        assert_close(full[i], hf_logits(hf, tokens), 1e-4, f"{name} seq {i} all positions")
