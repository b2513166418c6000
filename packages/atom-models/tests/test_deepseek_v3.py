"""DeepSeek-V3 / Kimi-K2 (and DeepSeek-V2) against transformers' own implementation on the same
random weights (float32), through the paged latent cache: both MLA formulations (absorbed into the
latent space, expanded to per-head K/V) at every step, Kimi-K2 configs read without remote code,
and the multi-token-prediction layer built at load."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV3Config

from atom_models import load_config, load_model, set_forward_context
from atom_models.native_host import (
    NativeMLAAttention,
    PagedAttentionMetadata,
    bind_kv_cache,
    kv_cache_bytes_per_token,
    set_mla_mode,
)
from atom_models.testing import add_random_mtp_layers

BASE = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    n_routed_experts=8,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
)

CONFIGS = {
    # DeepSeek-V3's shape: low-rank q, Dn != Dv, 4 groups (best 2 kept), top-3, one shared
    # expert, dense layer 0, DeepSeek YaRN (mscale / mscale_all_dim: the softmax scale changes).
    "v3-q-lora-yarn": lambda: DeepseekV3Config(
        **BASE,
        num_hidden_layers=2,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=24,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    ),
    # Kimi-K2's routing (one group), plain q_proj, non-interleaved rope, two dense layers, two
    # shared experts, unnormalized top-k weights.
    "kimi-one-group-q-proj": lambda: DeepseekV3Config(
        **BASE,
        num_hidden_layers=3,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=2,
        first_k_dense_replace=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_interleave=False,
    ),
    # DeepSeek-V2: softmax routing limited to the best 2 of 4 groups, unnormalized and scaled;
    # low-rank q; YaRN with V2's mscale (0.707 both).
    "v2-group-limited-yarn": lambda: DeepseekV2Config(
        **BASE,
        num_hidden_layers=2,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=24,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=16.0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
        },
    ),
    # DeepSeek-V2-Lite: plain q_proj, plain top-k softmax routing.
    "v2-lite-greedy": lambda: DeepseekV2Config(
        **BASE,
        num_hidden_layers=2,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        v_head_dim=16,
        topk_method="greedy",
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
    ),
}

PROMPT_LENGTHS = [7, 23, 1, 12, 30]


def prompts(vocab_size: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def max_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual - expected).abs().max().item()


@torch.no_grad()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0]  # [n, V]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request, make_checkpoint):
    path, hf = make_checkpoint(CONFIGS[request.param]())
    return request.param, path, load_model(path, dtype=torch.float32), hf


def test_latent_cache_holds_latent_and_rope_key_only(pair):
    name, _, model, hf = pair
    layers = [m for m in model.modules() if isinstance(m, NativeMLAAttention)]
    assert len(layers) == hf.config.num_hidden_layers
    per_token = hf.config.num_hidden_layers * (32 + 8) * 4  # (L + R) fp32 values per layer
    assert kv_cache_bytes_per_token(model, torch.float32) == per_token


def test_absorbed_and_expanded_decode_match_each_other_and_transformers(pair, paged_session):
    """Prefill, then a chunk over the cached prefix, then one token per step for every sequence:
    the absorbed and the expanded formulation give the same logits at every step (1e-4), and
    both equal transformers' full forward over the whole sequence."""
    name, _, model, hf = pair
    batch = prompts(hf.config.vocab_size)
    reference = {i: hf_logits(hf, t) for i, t in enumerate(batch)}
    sessions = {}
    for mode in ("absorbed", "expanded"):
        sessions[mode] = paged_session(model, seed=3)

    def step(chunks: dict[int, list[int]]) -> dict[str, dict[int, torch.Tensor]]:
        out = {}
        for mode, session in sessions.items():
            set_mla_mode(model, mode)
            out[mode] = session.step(chunks)
        set_mla_mode(model, "auto")
        return out

    cut = {i: max(1, len(t) // 3) for i, t in enumerate(batch)}
    cut2 = {i: max(cut[i], (2 * len(t)) // 3) for i, t in enumerate(batch)}
    plan = [
        ({i: t[: cut[i]] for i, t in enumerate(batch)}, {i: 0 for i in cut}),
        ({i: t[cut[i] : cut2[i]] for i, t in enumerate(batch) if cut2[i] > cut[i]}, cut),
    ]
    for chunks, starts in plan:
        got = step(chunks)
        for i, tokens in chunks.items():
            expected = reference[i][starts[i] : starts[i] + len(tokens)]
            assert max_diff(got["absorbed"][i], got["expanded"][i]) < 1e-4, (name, i)
            assert max_diff(got["expanded"][i], expected) < 1e-4, (name, i)
    position = dict(cut2)
    steps = 0
    while any(position[i] < len(t) for i, t in enumerate(batch)):
        chunks = {i: [t[position[i]]] for i, t in enumerate(batch) if position[i] < len(t)}
        got = step(chunks)
        for i in chunks:
            absorbed, expanded = got["absorbed"][i][0], got["expanded"][i][0]
            assert max_diff(absorbed, expanded) < 1e-4, f"{name} seq {i} decode step {steps}"
            assert max_diff(absorbed, reference[i][position[i]]) < 1e-4, (name, i, steps)
            position[i] += 1
        steps += 1
    assert steps > 5


def test_auto_mode_steps_match_transformers(pair, paged_session):
    """The default mode: prefill-only (expanded), then a step mixing one-token decodes with
    multi-token chunks (split by sequence: decodes absorbed, chunks expanded), then the rest."""
    name, _, model, hf = pair
    batch = prompts(hf.config.vocab_size, seed=2)
    reference = {i: hf_logits(hf, t) for i, t in enumerate(batch)}
    session = paged_session(model, seed=5)
    done = {i: max(1, len(t) // 2) for i, t in enumerate(batch)}
    steps = [{i: t[: done[i]] for i, t in enumerate(batch)}]
    mixed = {}
    for i, t in enumerate(batch):
        if done[i] < len(t):
            mixed[i] = t[done[i] : done[i] + (1 if i % 2 == 0 else 5)]
    steps.append(mixed)
    assert {len(c) for c in mixed.values()} >= {1, 5}
    position = {i: 0 for i in done}
    for chunks in steps + [{i: t[done[i] + len(mixed.get(i, [])) :] for i, t in enumerate(batch)}]:
        chunks = {i: c for i, c in chunks.items() if c}
        out = session.step(chunks)
        for i, tokens in chunks.items():
            expected = reference[i][position[i] : position[i] + len(tokens)]
            assert max_diff(out[i], expected) < 1e-4, (name, i, position[i])
            position[i] += len(tokens)
    assert all(position[i] == len(t) for i, t in enumerate(batch))


def test_kimi_k2_config_and_mtp_layer_load(make_checkpoint, tmp_path):
    """A Kimi-K2-style checkpoint: model_type kimi_k2 with an auto_map to configuration code that
    is not even there (nothing remote runs), and a multi-token-prediction layer
    (model.layers.{num_hidden_layers}.*): it loads, computes transformers' logits, and builds the
    MTP layer in the model dtype (the router's correction bias in fp32)."""
    src, hf = make_checkpoint(CONFIGS["kimi-one-group-q-proj"](), seed=4)
    shutil.copytree(src, tmp_path, dirs_exist_ok=True)
    added = add_random_mtp_layers(tmp_path, num_layers=1, seed=5)
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "kimi_k2"
    config["auto_map"] = {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    }
    config.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (tmp_path / "config.json").write_text(json.dumps(config))

    loaded_config = load_config(tmp_path)
    assert loaded_config.model_type == "deepseek_v3"
    assert loaded_config.architectures == ["DeepseekV3ForCausalLM"]
    assert loaded_config.num_nextn_predict_layers == 1
    model = load_model(tmp_path, dtype=torch.float32)
    mtp = "model.layers.3"
    assert model.num_mtp_layers == 1
    assert torch.equal(model.mtp_layer().eh_proj.weight, added[f"{mtp}.eh_proj.weight"])
    model_bf16 = load_model(tmp_path, dtype=torch.bfloat16)
    assert model_bf16.mtp_layer().enorm.weight.dtype == torch.bfloat16
    assert model_bf16.mtp_layer().mlp.gate.e_score_correction_bias.dtype == torch.float32
    # The router weight is held in fp32 (no cast a call) with the bf16 model's values, as HF's.
    gate = model_bf16.mtp_layer().mlp.gate.weight
    assert gate.dtype == torch.float32
    assert torch.equal(gate, model.mtp_layer().mlp.gate.weight.to(torch.bfloat16).float())

    tokens = prompts(211, seed=6)[1]
    bind_kv_cache(model, 8, 4, torch.float32, "cpu")
    md = PagedAttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(6))], 4)
    with set_forward_context(md), torch.no_grad():
        logits = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
    assert max_diff(logits, hf_logits(hf, tokens)) < 1e-4
