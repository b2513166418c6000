"""Multi-token-prediction (MTP) layers of DeepSeek-V3 and GLM-4-MoE checkpoints as drafters.

Tiny random checkpoints saved by transformers, plus one random MTP layer
(`atom_models.testing.add_random_mtp_layers`: transformers has no MTP layer). Checked: the MTP
layer is loaded from exactly those tensors; the main forward is unchanged and leaves the MTP
cache alone; `mtp_forward` + `compute_mtp_logits` over the MTP layer's own paged cache (a
prefill, then a chained decode step) equal a reference that composes enorm / hnorm / eh_proj /
shared_head from the raw tensors and runs transformers' own decoder layer for the block.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

from atom_models import build_model, load_config, load_model, set_forward_context
from atom_models.models.mtp import MTPLayerMixin
from atom_models.native_host import (
    NativeAttentionHost,
    PagedAttentionMetadata,
    bind_kv_cache,
    kv_cache_bytes_per_token,
)
from atom_models.testing import (
    add_random_mtp_layers,
    fp8_block_quantize,
    write_quantized_checkpoint,
)
from atom_models.weights import CheckpointMismatchError, safetensors_files

CONFIGS = {
    # MLA with low-rank q, 4 expert groups (best 2), a shared expert; layer 0 dense, so the MTP
    # layer (index 2) is an MoE layer like DeepSeek-V3's.
    "deepseek_v3": lambda: DeepseekV3Config(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        n_routed_experts=8,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    ),
    # Plain q_proj, non-interleaved rope, and every layer dense: a dense MTP layer.
    "deepseek_v3-dense": lambda: DeepseekV3Config(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        n_routed_experts=8,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        first_k_dense_replace=3,
        rope_interleave=False,
    ),
    # GQA with q/k norms, qkv bias and partial rotary; routed + shared experts.
    "glm4_moe": lambda: Glm4MoeConfig(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        use_qk_norm=True,
        attention_bias=True,
    ),
}

# Tensors of the MTP layer that are not its decoder block.
MTP_ONLY = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


@dataclass
class Case:
    name: str
    config: object
    base: Path  # the checkpoint without MTP tensors
    path: Path  # the same main weights plus one MTP layer
    tensors: dict[str, torch.Tensor]  # everything in `path`
    prefix: str  # "model.layers.{num_hidden_layers}."


def write_checkpoint(path: Path, config_dict: dict, tensors: dict[str, torch.Tensor]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_dict))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, make_checkpoint, tmp_path_factory) -> Case:
    config = CONFIGS[request.param]()
    base, _ = make_checkpoint(config, seed=11)
    path = tmp_path_factory.mktemp(f"{request.param}-mtp")
    shutil.copytree(base, path, dirs_exist_ok=True)
    added = add_random_mtp_layers(path, num_layers=1, seed=12)
    tensors = load_file(path / "model.safetensors")
    assert set(tensors) == set(load_file(safetensors_files(base)[0])) | set(added)
    n = config.num_hidden_layers
    return Case(request.param, config, base, path, tensors, f"model.layers.{n}.")


@pytest.fixture(scope="module")
def mtp_model(case):
    return load_model(case.path)


class Blocks:
    """Per-sequence block tables over a shuffled pool, and the metadata of one step."""

    def __init__(self, num_blocks: int = 32, block_size: int = 4, seed: int = 0) -> None:
        self.block_size = block_size
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, query_lens: dict[int, int]) -> PagedAttentionMetadata:
        seq_lens, tables = [], []
        for seq, n in query_lens.items():
            end = self.lens.get(seq, 0) + n
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            self.lens[seq] = end
            seq_lens.append(end)
            tables.append(table)
        return PagedAttentionMetadata.build(
            seq_lens, list(query_lens.values()), tables, self.block_size
        )


def cache_tensors(model, layer_idx: int) -> list[torch.Tensor]:
    impl = model.model.layers[layer_idx].self_attn.attn.impl
    names = ("kv_cache", "k_cache", "v_cache")
    return [t for t in (getattr(impl, a, None) for a in names) if t is not None]


# -- loading ---------------------------------------------------------------------------------


def test_mtp_layer_is_built_from_exactly_the_mtp_tensors(case, mtp_model):
    """One MTP layer after the decoder stack, holding the checkpoint's MTP tensors (the strict
    loader consumed every one and filled every parameter); the embedding copy is not kept."""
    model, n, p, t = mtp_model, case.config.num_hidden_layers, case.prefix, case.tensors
    assert model.num_mtp_layers == 1
    assert len(model.model.layers) == n + 1
    layer = model.mtp_layer(0)
    assert layer is model.mtp_layer(1) is model.model.layers[n]
    assert isinstance(layer, MTPLayerMixin)
    for leaf in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.weight",
    ):
        assert torch.equal(layer.get_parameter(leaf), t[p + leaf]), leaf
    assert layer.shared_head.head.weight.data_ptr() != model.lm_head.weight.data_ptr()
    if case.name == "deepseek_v3-dense":  # index 2 < first_k_dense_replace: a dense MLP
        mlp = p + "mlp."
        gate_up = torch.cat([t[mlp + "gate_proj.weight"], t[mlp + "up_proj.weight"]])
        assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    else:
        for leaf in ("mlp.gate.weight", "mlp.gate.e_score_correction_bias"):
            assert torch.equal(layer.get_parameter(leaf), t[p + leaf]), leaf
        experts, expert = layer.mlp.experts, p + "mlp.experts.5."
        gate_up = torch.cat([t[expert + "gate_proj.weight"], t[expert + "up_proj.weight"]])
        assert torch.equal(experts.w13_weight[5], gate_up)
        assert torch.equal(experts.w2_weight[5], t[expert + "down_proj.weight"])
    embeddings = [name for name, _ in model.named_parameters() if "embed_tokens" in name]
    assert embeddings == ["model.embed_tokens.weight"]
    # The main layers hold the main tensors, not the MTP layer's.
    assert torch.equal(
        model.model.layers[n - 1].input_layernorm.weight,
        t[f"model.layers.{n - 1}.input_layernorm.weight"],
    )


def test_missing_or_extra_mtp_tensors_are_named(case, tmp_path):
    config_dict = json.loads((case.path / "config.json").read_text())
    missing = {k: v for k, v in case.tensors.items() if k != case.prefix + "hnorm.weight"}
    with pytest.raises(CheckpointMismatchError, match="hnorm"):
        load_model(write_checkpoint(tmp_path / "missing", config_dict, missing))
    extra = {**case.tensors, case.prefix + "eh_proj.bias": torch.zeros(64)}
    with pytest.raises(CheckpointMismatchError, match="eh_proj.bias"):
        load_model(write_checkpoint(tmp_path / "extra", config_dict, extra))


def test_mtp_head_falls_back_to_the_lm_head(case, tmp_path):
    config_dict = json.loads((case.path / "config.json").read_text())
    headless = {
        k: v for k, v in case.tensors.items() if k != case.prefix + "shared_head.head.weight"
    }
    model = load_model(write_checkpoint(tmp_path / "headless", config_dict, headless))
    assert model.mtp_layer().shared_head.head.weight is model.lm_head.weight
    hidden = torch.randn(3, case.config.hidden_size)
    head = model.mtp_layer().shared_head
    expected = model.compute_logits(head.norm(hidden))
    assert torch.equal(model.compute_mtp_logits(hidden), expected)


def test_no_mtp_layers_without_config_or_under_a_host_that_drafts_itself(case):
    """The checkpoint without MTP (and the MTP checkpoint built for a host that does not build
    MTP layers, like vLLM's and SGLang's) has the plain decoder stack: its MTP tensors are
    skipped, the cache is the decoder stack's, and the drafter methods say why they cannot."""
    base = load_model(case.base)
    config = load_config(case.path)
    assert config.num_nextn_predict_layers == 1
    foreign = build_model(config, host=NativeAttentionHost(builds_mtp_layers=False))
    with torch.no_grad():
        foreign.load_weights(load_file(case.path / "model.safetensors").items())
    for model in (base, foreign):
        assert model.num_mtp_layers == 0
        assert len(model.model.layers) == case.config.num_hidden_layers
        with pytest.raises(ValueError, match="no multi-token-prediction layers"):
            model.mtp_forward(torch.tensor([1]), torch.tensor([0]), torch.zeros(1, 64))
        with pytest.raises(ValueError, match="no multi-token-prediction layers"):
            model.compute_mtp_logits(torch.zeros(1, 64))
    assert kv_cache_bytes_per_token(foreign, torch.float32) == kv_cache_bytes_per_token(
        base, torch.float32
    )


def test_quantized_mtp_layer_loads_with_the_checkpoints_scales(case, tmp_path):
    """Block FP8 over every projection but eh_proj (stored unquantized, as DeepSeek-V3's FP8
    release stores it): the MTP layer's projections and experts are quantized like the decoder
    layers', and its draft logits stay close to the unquantized model's."""
    block = (16, 16)

    def quantize(name, tensor):
        q, scale_inv = fp8_block_quantize(tensor, block)
        return {name: q, name.replace(".weight", ".weight_scale_inv"): scale_inv}

    def select(name, tensor):
        projection = name.endswith(("_proj.weight", "_proj_with_mqa.weight"))
        return projection and "eh_proj" not in name and tensor.dim() == 2

    quant_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [16, 16],
    }
    path = write_quantized_checkpoint(case.path, tmp_path / "fp8", quant_config, quantize, select)
    model = load_model(path)
    layer = model.mtp_layer()
    assert layer.eh_proj.weight.dtype == torch.float32
    mlp = getattr(layer.mlp, "experts", None) or layer.mlp.gate_up_proj
    assert next(mlp.parameters()).dtype == torch.float8_e4m3fn
    assert layer.self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    # The same input hidden states for both: only the MTP layer's quantization differs.
    previous = torch.randn(9, case.config.hidden_size, generator=torch.Generator().manual_seed(4))
    got, expected = [], []
    for m, out in ((model, got), (load_model(case.path), expected)):
        blocks = Blocks(seed=4)
        bind_kv_cache(m, 32, blocks.block_size, torch.float32, "cpu")
        ids, positions = torch.arange(3, 12), torch.arange(9)
        with set_forward_context(blocks.step({0: 9})), torch.no_grad():
            out.append(m.compute_mtp_logits(m.mtp_forward(ids, positions, previous)))
    error = (got[0] - expected[0]).abs().max() / expected[0].abs().max()
    assert error < 0.1, error


# -- compute ---------------------------------------------------------------------------------


def test_main_forward_is_unchanged_and_leaves_the_mtp_cache_alone(case, mtp_model, paged_session):
    base = load_model(case.base)
    n = case.config.num_hidden_layers
    per_layer = kv_cache_bytes_per_token(base, torch.float32) // n
    assert kv_cache_bytes_per_token(mtp_model, torch.float32) == (n + 1) * per_layer
    gen = torch.Generator().manual_seed(5)
    chunks = {
        i: torch.randint(0, 211, (k,), generator=gen).tolist() for i, k in enumerate((7, 1, 12))
    }
    expected = paged_session(base, seed=2).step(chunks)
    got = paged_session(mtp_model, seed=2).step(chunks)
    for i in chunks:
        assert torch.equal(got[i], expected[i]), i
    assert all(bool((c == 0).all()) for c in cache_tensors(mtp_model, n))
    assert any(bool((c != 0).any()) for c in cache_tensors(mtp_model, n - 1))


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.fixture(scope="module")
def hf_block(case, tmp_path_factory):
    """transformers' model with one more decoder layer holding the MTP layer's block: that
    layer (transformers' own decoder layer, eager attention) and the model's rotary embedding."""
    n = case.config.num_hidden_layers
    config_dict = json.loads((case.base / "config.json").read_text())
    config_dict["num_hidden_layers"] = n + 1
    block = {
        k: v
        for k, v in case.tensors.items()
        if not (k.startswith(case.prefix) and k[len(case.prefix) :].startswith(MTP_ONLY))
    }
    path = write_checkpoint(tmp_path_factory.mktemp(f"{case.name}-hf"), config_dict, block)
    hf, info = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.model.layers[n].eval(), hf.model.rotary_emb


@torch.no_grad()
def reference_mtp(case, hf_block, ids, positions, previous_hidden):
    """One sequence's MTP hidden states [T, H] and logits [T, V] from the raw tensors."""
    t, p, eps = case.tensors, case.prefix, case.config.rms_norm_eps
    layer, rotary = hf_block
    embeds = t["model.embed_tokens.weight"][ids].clone()
    embeds[positions == 0] = 0.0
    x = torch.cat(
        [rms(embeds, t[p + "enorm.weight"], eps), rms(previous_hidden, t[p + "hnorm.weight"], eps)],
        -1,
    )
    x = (x @ t[p + "eh_proj.weight"].T)[None]  # [1, T, H]
    num_tokens = len(ids)
    mask = torch.full((num_tokens, num_tokens), float("-inf")).triu(1)[None, None]
    out = layer(
        x,
        attention_mask=mask,
        position_ids=positions[None],
        position_embeddings=rotary(x, positions[None]),
    )
    hidden = (out[0] if isinstance(out, tuple) else out)[0]
    logits = rms(hidden, t[p + "shared_head.norm.weight"], eps) @ t[p + "shared_head.head.weight"].T
    return hidden, logits


def test_mtp_forward_and_logits_match_reference_over_the_paged_cache(case, mtp_model, hf_block):
    """A batch like the engine's: the target prefills the prompts, the MTP layer drafts from its
    hidden states (step 0, the prompts shifted by one token, in the same forward context), then a
    chained decode step (step 1) takes the last draft's hidden state and reads the MTP layer's
    cached prefix. Every row equals the reference over the whole sequence at once."""
    model, hidden_size = mtp_model, case.config.hidden_size
    gen = torch.Generator().manual_seed(8)
    lengths = {0: 9, 1: 1, 2: 14}
    tokens = {i: torch.randint(0, 211, (k + 2,), generator=gen) for i, k in lengths.items()}
    blocks = Blocks(seed=6)
    bind_kv_cache(model, 32, blocks.block_size, torch.float32, "cpu")
    ids = torch.cat([tokens[i][:k] for i, k in lengths.items()])
    draft_ids = torch.cat([tokens[i][1 : k + 1] for i, k in lengths.items()])
    positions = torch.cat([torch.arange(k) for k in lengths.values()])
    with set_forward_context(blocks.step(lengths)), torch.no_grad():
        target_hidden = model(ids, positions)  # [T, H]
        draft_hidden = model.mtp_forward(draft_ids, positions, target_hidden, step=0)
        draft_logits = model.compute_mtp_logits(draft_hidden, step=0)
    assert draft_hidden.shape == target_hidden.shape == (len(ids), hidden_size)
    ends = torch.tensor(list(lengths.values())).cumsum(0) - 1
    decode_ids = torch.stack([tokens[i][k + 1] for i, k in lengths.items()])
    decode_positions = torch.tensor(list(lengths.values()))
    with set_forward_context(blocks.step({i: 1 for i in lengths})), torch.no_grad():
        chained = model.mtp_forward(decode_ids, decode_positions, draft_hidden[ends], step=1)
        chained_logits = model.compute_mtp_logits(chained, step=1)

    start = 0
    for row, (i, k) in enumerate(lengths.items()):
        seq_ids = torch.cat([tokens[i][1 : k + 1], tokens[i][k + 1 :]])
        previous = torch.cat(
            [target_hidden[start : start + k], draft_hidden[start + k - 1 : start + k]]
        )
        hidden, logits = reference_mtp(case, hf_block, seq_ids, torch.arange(k + 1), previous)
        torch.testing.assert_close(draft_hidden[start : start + k], hidden[:k], atol=1e-4, rtol=0)
        torch.testing.assert_close(draft_logits[start : start + k], logits[:k], atol=1e-4, rtol=0)
        torch.testing.assert_close(chained[row], hidden[k], atol=1e-4, rtol=0)
        torch.testing.assert_close(chained_logits[row], logits[k], atol=1e-4, rtol=0)
        start += k
    # Position 0 drafts from the hidden state alone: its token does not matter.
    with set_forward_context(Blocks(seed=1).step({0: 1})), torch.no_grad():
        bind_kv_cache(model, 32, 4, torch.float32, "cpu")
        a = model.mtp_forward(torch.tensor([3]), torch.tensor([0]), target_hidden[:1])
        bind_kv_cache(model, 32, 4, torch.float32, "cpu")
        b = model.mtp_forward(torch.tensor([77]), torch.tensor([0]), target_hidden[:1])
    assert torch.equal(a, b)
