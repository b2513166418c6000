"""An fp8 (float8_e4m3fn) KV cache on the native host: logits over a 64-token paged decode stay
within a stated tolerance of the fp32 cache's (standard attention and MLA), and the per-tensor
k/v scales load from the checkpoint under every name checkpoints give them."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, LlamaConfig

from atom_models import load_model, set_forward_context
from atom_models.native_host import (
    NativeAttention,
    NativeMLAAttention,
    PagedAttentionMetadata,
    bind_kv_cache,
    cache_layers,
)
from atom_models.weights import CheckpointMismatchError, safetensors_files

FP8 = torch.float8_e4m3fn
LLAMA = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
DEEPSEEK = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=256,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    # Dense MLP layers only: with random experts one flipped top-k choice (a legitimate effect of
    # any perturbation) moved a logit by 0.44 of max |logit| in a first version of this test.
    first_k_dense_replace=2,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
)
# NOTE: measured on these tiny random models (O(1) activations, max |logit| ~4-5), CPU, fp32
# math: the fp8 cache's largest logit difference over the 64 decode steps was 0.020 (Llama) and
# 0.017 (DeepSeek-V3 MLA) of max |logit|; fp8 e4m3 keeps 3 mantissa bits (relative rounding up to
# 1/16 per cached value). The bound leaves 2.5x of margin.
RELATIVE_TOLERANCE = 0.05


def _decode_logits(model, cache_dtype, prompt: list[int], steps: int, block_size: int = 4):
    """Prefill `prompt` into a freshly bound paged cache (shuffled blocks), then decode `steps`
    tokens one per step, teacher-forced with a fixed token sequence; the logits of every step
    [steps + 1, V] (the prefill's last row first)."""
    total = len(prompt) + steps
    num_blocks = -(-total // block_size) + 2
    bind_kv_cache(model, num_blocks, block_size, cache_dtype, "cpu")
    table = list(range(num_blocks))
    random.Random(0).shuffle(table)
    forced = torch.Generator().manual_seed(9)
    tokens = list(prompt)
    out = []
    with torch.no_grad():
        start, new = 0, list(prompt)
        for _ in range(steps + 1):
            end = start + len(new)
            md = PagedAttentionMetadata.build(
                [end], [len(new)], [table[: -(-end // block_size)]], block_size
            )
            with set_forward_context(md):
                hidden = model(torch.tensor(new), torch.arange(start, end))
            out.append(model.compute_logits(hidden[-1:])[0])
            nxt = int(torch.randint(model.config.vocab_size, (1,), generator=forced))
            tokens.append(nxt)
            start, new = end, [nxt]
    return torch.stack(out)


@pytest.fixture(scope="module", params=["llama", "deepseek_v3-mla"])
def model(request, make_checkpoint):
    config = LlamaConfig(**LLAMA) if request.param == "llama" else DeepseekV3Config(**DEEPSEEK)
    path, _ = make_checkpoint(config, seed=3)
    return load_model(path, dtype=torch.float32)


def test_fp8_cache_logits_within_tolerance_of_fp32_over_64_token_decode(model):
    prompt = torch.randint(model.config.vocab_size, (13,), generator=torch.Generator()).tolist()
    reference = _decode_logits(model, torch.float32, prompt, steps=64)
    fp8 = _decode_logits(model, FP8, prompt, steps=64)
    for layer in cache_layers(model):
        cache = layer.k_cache if isinstance(layer, NativeAttention) else layer.kv_cache
        assert cache.dtype == FP8
    scale = reference.abs().max()
    worst = float((fp8 - reference).abs().max() / scale)
    print(f"fp8 vs fp32 cache: max |logit diff| = {worst:.4f} of max |logit|")
    assert worst <= RELATIVE_TOLERANCE, f"fp8 logits differ by {worst:.3f} of max |logit|"
    assert worst > 0, "the fp8 cache changed nothing: was it used?"


def _with_tensors(path, extra: dict[str, torch.Tensor]) -> None:
    """Add tensors to the checkpoint's (single) safetensors file."""
    (file,) = safetensors_files(path)
    tensors = load_file(file)
    tensors.update(extra)
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture
def llama_dir(make_checkpoint):
    """A fresh tiny Llama checkpoint directory (the test may add tensors to it)."""
    return make_checkpoint(LlamaConfig(**LLAMA), seed=4)[0]


def _attention_layers(model) -> list[NativeAttention]:
    return [m for m in cache_layers(model) if isinstance(m, NativeAttention)]


def test_checkpoint_kv_scales_load_under_every_name(llama_dir):
    _with_tensors(
        llama_dir,
        {
            # compressed-tensors kv_cache_scheme / ModelOpt: a scalar beside the projections
            "model.layers.0.self_attn.k_scale": torch.tensor(0.0625),
            "model.layers.0.self_attn.v_scale": torch.tensor(0.03125),
            # older exports: the k/v projections' output scales, one-element tensors
            "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([0.25]),
            "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([0.125]),
        },
    )
    model = load_model(llama_dir, dtype=torch.bfloat16)
    attn = [model.model.layers[i].self_attn.attn for i in range(2)]
    loaded = [(float(a.k_scale), float(a.v_scale)) for a in attn]
    assert loaded == [(0.0625, 0.03125), (0.25, 0.125)]
    bind_kv_cache(model, 4, 4, FP8, "cpu")
    layers = _attention_layers(model)
    assert [(x.k_scale, x.v_scale) for x in layers] == [(0.0625, 0.03125), (0.25, 0.125)]
    # With the model's dtype (kv_cache_dtype auto) the scales are accepted and unused.
    bind_kv_cache(model, 4, 4, torch.bfloat16, "cpu")
    assert [(x.k_scale, x.v_scale) for x in layers] == [(None, None), (None, None)]


def test_checkpoint_kv_scales_under_the_layer_name_and_defaults(llama_dir):
    # The layer's own name (vLLM's `...self_attn.attn.k_scale`); layer 1 gives none: 1.0.
    _with_tensors(llama_dir, {"model.layers.0.self_attn.attn.k_scale": torch.tensor([0.5])})
    model = load_model(llama_dir, dtype=torch.float32)
    attn = [model.model.layers[i].self_attn.attn for i in range(2)]
    assert [(float(a.k_scale), float(a.v_scale)) for a in attn] == [(0.5, 1.0), (1.0, 1.0)]
    bind_kv_cache(model, 4, 4, FP8, "cpu")
    assert [(x.k_scale, x.v_scale) for x in _attention_layers(model)] == [(0.5, 1.0), (1.0, 1.0)]


def test_checkpoint_scales_give_fp8_logits_within_tolerance(llama_dir):
    """Scales like a calibration's (amax / 448 of this model's keys and values) keep the cache's
    values in fp8's normal range; the logits stay within the same tolerance of fp32's."""
    scales = {}
    for i in range(2):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01)
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.008)
    _with_tensors(llama_dir, scales)
    model = load_model(llama_dir, dtype=torch.float32)
    prompt = list(range(5, 30))
    reference = _decode_logits(model, torch.float32, prompt, steps=64)
    fp8 = _decode_logits(model, FP8, prompt, steps=64)
    worst = float((fp8 - reference).abs().max() / reference.abs().max())
    print(f"fp8 cache with checkpoint scales: max |logit diff| = {worst:.4f} of max |logit|")
    assert 0 < worst <= RELATIVE_TOLERANCE, f"fp8 logits differ by {worst:.3f} of max |logit|"


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "model.layers.1.self_attn.v_scale",
            torch.ones(4),
            r"model\.layers\.1\.self_attn\.v_scale -> model\.layers\.1\.self_attn\.attn\.v_scale: "
            r"v_scale must be one per-tensor value, got shape \(4,\)",
        ),
        (
            "model.layers.0.self_attn.k_proj.output_scale",
            torch.tensor([-1.0]),
            "k_scale must be a positive finite number, got -1.0",
        ),
    ],
)
def test_bad_checkpoint_scale_is_a_clear_error(llama_dir, name, value, message):
    _with_tensors(llama_dir, {name: value})
    with pytest.raises(CheckpointMismatchError, match=message):
        load_model(llama_dir)


def test_mla_latent_cache_takes_the_k_scale(make_checkpoint):
    path, _ = make_checkpoint(DeepseekV3Config(**DEEPSEEK), seed=5)
    _with_tensors(
        path,
        {
            "model.layers.0.self_attn.k_scale": torch.tensor(0.046875),
            "model.layers.0.self_attn.v_scale": torch.tensor(0.07),  # accepted, unused
        },
    )
    model = load_model(path, dtype=torch.float32)
    bind_kv_cache(model, 4, 4, FP8, "cpu")
    layers = [m for m in cache_layers(model) if isinstance(m, NativeMLAAttention)]
    assert [layer.kv_scale for layer in layers] == [0.046875, 1.0]
    assert all(layer.kv_cache.dtype == FP8 for layer in layers)
