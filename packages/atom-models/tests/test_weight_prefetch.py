"""A decoder layer's L2 prefetch (layers/prefetch.py): which modules it asks for and in what
order, the chunk table for a budget (o_proj whole, then the leading part of gate_up's weight),
the W4A16 layer's packed words and scales, and nothing done on CPU tensors. The GPU engine test
(test_gpu_engine.py::test_l2_prefetch_changes_no_value) runs it inside CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, LlamaConfig, Qwen3MoeConfig

from atom_models.layers import prefetch as prefetch_mod
from atom_models.layers.prefetch import Plan, WeightPrefetch, module_tensors, parse_plan
from atom_models.loader import materialize
from atom_models.models.deepseek_v3 import DeepseekV3DecoderLayer
from atom_models.models.llama import LlamaDecoderLayer, LlamaModel
from atom_models.models.qwen3_moe import Qwen3MoeDecoderLayer
from atom_models.quantization import parse_quant_config, quantize_model

SMALL = dict(vocab_size=64, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2)  # fmt: skip


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def test_layer_asks_for_o_proj_then_gate_up():
    layer = LlamaDecoderLayer(LlamaConfig(**SMALL, intermediate_size=256), 0, "model.layers.0")
    prefetch = layer.self_attn.prefetch
    o, gate_up = layer.self_attn.o_proj, layer.mlp.gate_up_proj
    assert prefetch.modules == [o, gate_up]
    early = layer.self_attn.prefetch_early  # the same modules, from before QKV
    assert early.stage == "qkv" and early.modules is prefetch.modules
    o_bytes = _bytes(o.weight)
    spans = prefetch.spans(o_bytes + _bytes(gate_up.weight) // 4)
    starts = spans[:, 0].tolist()
    assert starts[0] == o.weight.data_ptr() & -16
    covered = sum(spans[:, 1].tolist())
    assert (
        o_bytes + _bytes(gate_up.weight) // 4
        <= covered
        <= o_bytes + _bytes(gate_up.weight) // 4 + 32
    )
    g = gate_up.weight.data_ptr()
    assert min(a for a in starts if a >= g & -16) == g & -16  # gate_up from its first row
    assert prefetch.spans(o_bytes + _bytes(gate_up.weight) // 4) is spans  # built once


def test_moe_layer_asks_for_o_proj_alone():
    config = Qwen3MoeConfig(**SMALL, moe_intermediate_size=32, num_experts=4,
                            num_experts_per_tok=2, head_dim=32)  # fmt: skip
    layer = Qwen3MoeDecoderLayer(config, 0, "model.layers.0")
    assert layer.self_attn.prefetch.modules == [layer.self_attn.o_proj]


def test_w4a16_layer_prefetches_its_packed_tensors():
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
               "symmetric": False}  # fmt: skip
    config = LlamaConfig(**SMALL, intermediate_size=256, quantization_config={
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"g": {"targets": ["Linear"], "weights": weights}}})  # fmt: skip
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0, "model.layers.0")
        quantize_model(layer, parse_quant_config(config), torch.bfloat16)
    materialize(layer, "cpu", torch.bfloat16)
    o = layer.self_attn.o_proj
    tensors = module_tensors(o)
    assert len(tensors) >= 3 and tensors[0].dtype == torch.int32  # words, scales, zeros
    total = sum(_bytes(t) for t in tensors)
    spans = WeightPrefetch("attn", [o]).spans(total)
    for t in tensors:
        assert any(a <= t.data_ptr() < a + n for a, n in spans.tolist())


def test_nothing_on_cpu(monkeypatch):
    monkeypatch.setenv("ATOM_L2_PREFETCH", "attn=64,mlp=32,next=16")
    layer = LlamaDecoderLayer(LlamaConfig(**SMALL, intermediate_size=256), 0, "model.layers.0")
    prefetch = layer.self_attn.prefetch
    prefetch.start(torch.zeros(1, 128))
    prefetch_mod.join(torch.zeros(1, 128))
    assert prefetch._spans is None and not prefetch_mod._PENDING


def test_plan_parses_stages_in_mb():
    assert parse_plan("") == Plan({}, False)
    want = {"attn": 32 << 20, "mlp": 24 << 20, "next": 0}
    assert parse_plan("attn=32, mlp=24,next=0") == Plan(want, False)
    assert parse_plan("attn=32,mlp=24,next=0,last") == Plan(want, True)
    for bad in ("attn", "attn=x", "down=8", "attn=-1", "first"):
        with pytest.raises(ValueError, match="ATOM_L2_PREFETCH"):
            parse_plan(bad)
    with pytest.raises(ValueError, match="stage"):
        WeightPrefetch("lm_head", [])


def test_model_chains_each_mlp_to_the_next_layers_qkv():
    """Each layer's MLP asks for its down projection (stage mlp) and the next layer's QKV
    projection (stage next); the last layer's for nothing (the LM head is outside the graph)."""
    model = LlamaModel(LlamaConfig(**dict(SMALL, num_hidden_layers=3), intermediate_size=256))
    layers = list(model.layers)
    for layer, after in zip(layers, [*layers[1:], None], strict=True):
        assert layer.mlp.prefetch_down.stage == "mlp"
        assert layer.mlp.prefetch_down.modules == [layer.mlp.down_proj]
        want = [] if after is None else [after.self_attn.qkv_proj]
        assert layer.mlp.prefetch_next.stage == "next" and layer.mlp.prefetch_next.modules == want


def test_deepseek_v3_layers_ask_for_o_proj_then_the_first_known_gemm():
    """MLA layers start the attn stage before the attention: o_proj, then a dense layer's gate_up
    or an MoE layer's shared experts' (the routed experts wait on the router)."""
    config = DeepseekV3Config(
        vocab_size=211, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
        n_routed_experts=8, kv_lora_rank=32, qk_rope_head_dim=8, num_hidden_layers=2,
        q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=24, n_group=4, topk_group=2,
        num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
    )  # fmt: skip
    dense, moe = (DeepseekV3DecoderLayer(config, i, f"model.layers.{i}") for i in (0, 1))
    assert dense.self_attn.prefetch.modules == [dense.self_attn.o_proj, dense.mlp.gate_up_proj]
    assert moe.self_attn.prefetch.modules == [
        moe.self_attn.o_proj,
        moe.mlp.shared_experts.gate_up_proj,
    ]
