"""Integer checkpoints' quantization_config: GPTQ, AWQ, compressed-tensors int-quantized and
pack-quantized, several config groups, and the variants ATOM rejects (with what it loads)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import Qwen3MoeConfig

from atom_models.loader import build_model
from atom_models.quantization import parse_quant_config
from atom_models.quantization.config import INT8, WNA16, QuantScheme
from atom_models.quantization.int_methods import (
    Int8LinearMethod,
    Wna16LinearMethod,
    Wna16MoEMethod,
)


def parse(raw: dict):
    return parse_quant_config(SimpleNamespace(quantization_config=raw))


INT8_ARGS = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": False}


def ct(groups: dict, fmt: str = "pack-quantized", ignore=("lm_head",)) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": groups,
        "ignore": list(ignore),
    }


def w4a16(**weights) -> dict:
    args = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    return {"targets": ["Linear"], "weights": {**args, **weights}}


def w8a8(strategy="channel", acts=None, targets=("Linear",)) -> dict:
    acts = acts or {**INT8_ARGS, "strategy": "token", "dynamic": True}
    return {
        "targets": list(targets),
        "weights": {**INT8_ARGS, "strategy": strategy},
        "input_activations": acts,
    }


def test_gptq():
    q = parse({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
               "sym": False, "modules_to_not_convert": ["mlp.gate"]})  # fmt: skip
    assert q.linear == QuantScheme(WNA16, checkpoint="gptq", bits=4, group_size=128,
                                   symmetric=False, g_idx=True)  # fmt: skip
    assert q.linear_scheme(["model.layers.0.self_attn.q_proj"]) == q.linear
    assert q.linear_scheme(["lm_head"]) is None and q.linear_scheme(["x.mlp.gate"]) is None
    v2 = parse(
        {"quant_method": "gptq", "bits": 8, "group_size": -1, "checkpoint_format": "gptq_v2"}
    )
    assert (v2.linear.checkpoint, v2.linear.bits, v2.linear.group_size) == ("gptq_v2", 8, -1)
    assert v2.linear.symmetric and not v2.linear.g_idx


def test_gptq_modules_in_block_to_quantize():
    blocks = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.down_proj"]]
    q = parse({"quant_method": "gptq", "bits": 4, "group_size": 32,
               "modules_in_block_to_quantize": blocks})  # fmt: skip
    names = ["m.layers.0.self_attn.q_proj", "m.layers.0.self_attn.k_proj",
             "m.layers.0.self_attn.v_proj"]  # fmt: skip
    assert q.linear_scheme(names) == q.linear
    assert q.linear_scheme(["m.layers.0.mlp.down_proj"]) == q.linear
    assert q.linear_scheme(["m.layers.0.mlp.gate_proj", "m.layers.0.mlp.up_proj"]) is None
    with pytest.raises(ValueError, match="fused into one layer"):
        q.linear_scheme(["m.layers.0.self_attn.o_proj", "m.layers.0.self_attn.q_proj"])


def test_awq():
    q = parse({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
               "version": "GEMM", "modules_to_not_convert": ["visual"]})  # fmt: skip
    assert q.linear == QuantScheme(WNA16, checkpoint="awq", bits=4, group_size=64,
                                   symmetric=False)  # fmt: skip
    assert q.linear_scheme(["visual.blocks.0.attn.qkv"]) is None


def test_compressed_tensors_w8a8():
    q = parse(ct({"g": w8a8()}, fmt="int-quantized"))
    assert q.linear == QuantScheme(INT8, channel_scale=True)
    static = {**INT8_ARGS, "strategy": "tensor", "dynamic": False}
    q = parse(ct({"g": w8a8("tensor", static)}, fmt="naive-quantized"))
    assert q.linear == QuantScheme(INT8, static_input_scale=True, channel_scale=False)


@pytest.mark.parametrize(
    "weights, expected",
    [
        ({}, dict(bits=4, group_size=32)),
        ({"strategy": "channel", "group_size": None, "num_bits": 8}, dict(bits=8)),
        ({"symmetric": False, "actorder": "group"},
         dict(bits=4, group_size=32, symmetric=False, g_idx=True)),
        ({"actorder": "weight"}, dict(bits=4, group_size=32)),  # no g_idx stored
    ],
)  # fmt: skip
def test_compressed_tensors_pack_quantized(weights, expected):
    q = parse(ct({"g": w4a16(**weights)}))
    assert q.linear == q.moe == QuantScheme(WNA16, checkpoint="ct", **expected)


def test_kimi_k2_thinking_layout():
    """One W4A16 group over "Linear", with attention, shared experts, dense MLPs and the head
    in `ignore`: the routed experts only are quantized."""
    ignore = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:model\.layers\.0\.mlp.*"]
    q = parse(ct({"group_0": w4a16()}, ignore=ignore))
    assert q.linear_scheme(["model.layers.1.self_attn.q_a_proj"]) is None
    assert q.linear_scheme(["model.layers.1.mlp.shared_experts.gate_proj"]) is None
    assert q.linear_scheme(["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]) is None
    expert = ["model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.experts.0.up_proj"]
    assert q.moe_scheme("model.layers.1.mlp.experts", expert) == q.moe


def test_several_groups_each_module_gets_its_groups_scheme():
    groups = {
        "attention": {**w8a8(targets=["re:.*self_attn.*"])},
        "experts": {**w4a16(), "targets": ["re:.*mlp.experts.*"], "format": "pack-quantized"},
        "rest": {**w4a16(num_bits=8, strategy="channel", group_size=None),
                 "format": "pack-quantized"},
    }  # fmt: skip
    groups["attention"]["format"] = "int-quantized"
    q = parse(ct(groups, fmt="mixed-precision"))
    assert len(q.groups) == 3
    qkv = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert q.linear_scheme(qkv).weight == INT8
    experts = [f"model.layers.0.mlp.experts.0.{p}_proj" for p in ("gate", "up", "down")]
    assert q.moe_scheme("model.layers.0.mlp.experts", experts).group_size == 32
    # no group names it but "Linear" covers it: the catch-all group
    assert q.linear_scheme(["model.layers.0.mlp.shared_expert.down_proj"]).bits == 8
    assert q.linear_scheme(["lm_head"]) is None
    with pytest.raises(ValueError, match="not quantized alike"):
        q.linear_scheme(["model.layers.0.self_attn.q_proj", "model.layers.0.mlp.gate_proj"])


def test_groups_pick_each_layers_method_in_a_model():
    groups = {
        "attention": {**w8a8(targets=["re:.*self_attn.*"]), "format": "int-quantized"},
        "experts": {**w4a16(symmetric=False), "targets": ["re:.*mlp.experts.*"],
                    "format": "pack-quantized"},
    }  # fmt: skip
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=64,
                            moe_intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2,
                            architectures=["Qwen3MoeForCausalLM"])  # fmt: skip
    config.quantization_config = ct(groups, fmt="mixed-precision", ignore=["lm_head"])
    model = build_model(config, device="meta")
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant_method, Int8LinearMethod)
    assert isinstance(layer.self_attn.o_proj.quant_method, Int8LinearMethod)
    assert isinstance(layer.mlp.experts.quant_method, Wna16MoEMethod)
    assert "w13_weight_zero_point" in dict(layer.mlp.experts.named_parameters())
    assert not hasattr(layer.mlp.gate, "quant_method") or not isinstance(
        layer.mlp.gate.quant_method, (Int8LinearMethod, Wna16LinearMethod)
    )


REJECTED = {
    "gptq-3bit": ({"quant_method": "gptq", "bits": 3, "group_size": 128}, r"bits 3"),
    "gptq-marlin-format": (
        {"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
        r"checkpoint_format 'marlin'",
    ),
    "gptq-quantized-lm-head": ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "lm_head"),
    "gptq_marlin": ({"quant_method": "gptq_marlin", "bits": 4}, r"'gptq_marlin' is not supported"),
    "marlin": ({"quant_method": "marlin"}, r"'marlin' is not supported"),
    "awq-gemv": ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"version 'gemv'"),
    "awq-gemv-fast": ({"quant_method": "awq", "bits": 4, "version": "gemv_fast"}, "gemv_fast"),
    "awq-2bit": ({"quant_method": "awq", "bits": 2, "version": "gemm"}, r"bits 2"),
    "awq-no-zeros": ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point"),
    "ct-3bit": (ct({"g": w4a16(num_bits=3)}), r"3-bit int weights"),
    "ct-w4-unpacked": (ct({"g": w4a16()}, fmt="naive-quantized"), "weight-only int weights"),
    "ct-asym-activations": (
        ct(
            {
                "g": w8a8(
                    acts={**INT8_ARGS, "strategy": "token", "dynamic": True, "symmetric": False}
                )
            },
            fmt="int-quantized",
        ),
        "asymmetric int8 activations",
    ),  # fmt: skip
    "ct-w4a8": (
        ct(
            {
                "g": {
                    **w4a16(),
                    "input_activations": {**INT8_ARGS, "strategy": "token", "dynamic": True},
                }
            },
            fmt="int-quantized",
        ),
        "W8A8 needs symmetric 8-bit weights",
    ),  # fmt: skip
    "ct-fp4": (
        ct(
            {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "group"}}},
            fmt="float-quantized",
        ),
        "4 bits, type 'float'",
    ),  # fmt: skip
    "ct-marlin-24": (ct({"g": w4a16()}, fmt="marlin-24"), "format 'marlin-24'"),
}


@pytest.mark.parametrize("name", REJECTED)
def test_unsupported_variants_name_themselves_and_list_what_atom_loads(name):
    raw, message = REJECTED[name]
    with pytest.raises(ValueError, match=message) as info:
        parse(raw)
    assert "ATOM loads" in str(info.value) and "gptq (4/8-bit" in str(info.value)


def test_kimi_k2_thinking_config_on_a_deepseek_v3_model():
    """Kimi-K2-Thinking's quantization_config (one W4A16 group over "Linear"; attention, shared
    experts, dense MLPs and the head ignored) on a DeepSeek-V3-shaped model: only the routed
    experts are WNA16 (4-bit, groups of 32)."""
    from transformers import DeepseekV3Config

    from atom_models.layers.linear import UNQUANTIZED

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=96,
                              moe_intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                              n_group=2, topk_group=1, n_shared_experts=1,
                              first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=32,
                              qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              architectures=["DeepseekV3ForCausalLM"])  # fmt: skip
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
               "symmetric": True, "dynamic": False, "actorder": None}  # fmt: skip
    config.quantization_config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": None}},
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                   "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    }  # fmt: skip
    model = build_model(config, device="meta")
    dense, moe = model.model.layers[0], model.model.layers[1]
    assert isinstance(moe.mlp.experts.quant_method, Wna16MoEMethod)
    params = dict(moe.mlp.experts.named_parameters())
    assert params["w13_weight_packed"].shape == (4, 64, 64 // 8)
    assert params["w2_weight_scale"].shape == (4, 64, 32 // 32)
    assert moe.mlp.shared_experts.gate_up_proj.quant_method is UNQUANTIZED
    assert dense.mlp.gate_up_proj.quant_method is UNQUANTIZED
    assert moe.self_attn.o_proj.quant_method is UNQUANTIZED
