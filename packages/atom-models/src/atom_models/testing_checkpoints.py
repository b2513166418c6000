"""Tiny random checkpoints of every quantized format ATOM loads, written as each format publishes
them (the packing from `atom_models.testing`): for tests in any package and host that need a real
quantized checkpoint directory (atom-vllm-plugin's `test_quantized.py`). Each writer takes a
temporary directory and returns the checkpoint's directory inside it.
"""

from __future__ import annotations

from pathlib import Path

BLOCK = (32, 64)  # block FP8's [rows, columns] per scale

LLAMA = dict(
    vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
)  # fmt: skip
GPT_OSS = dict(
    vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
)  # fmt: skip


def tiny_llama(tmp: Path) -> Path:
    """The unquantized tiny Llama the quantized ones are made from."""
    from transformers import LlamaConfig

    from atom_models.testing import save_random_checkpoint

    save_random_checkpoint(LlamaConfig(**LLAMA), tmp / "llama", seed=7)
    return tmp / "llama"


def block_fp8_checkpoint(tmp: Path) -> Path:
    """DeepSeek-V3 / Qwen3-FP8 layout: float8_e4m3fn weights, fp32 `weight_scale_inv` per block."""
    from atom_models.testing import fp8_block_quantize, write_quantized_checkpoint

    def quantize(name, tensor):
        q, scale_inv = fp8_block_quantize(tensor, BLOCK)
        return {name: q, name.replace(".weight", ".weight_scale_inv"): scale_inv}

    config = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}  # fmt: skip
    return write_quantized_checkpoint(tiny_llama(tmp), tmp / "fp8-block", config, quantize)


def compressed_fp8_checkpoint(tmp: Path, static: bool = False) -> Path:
    """llm-compressor's FP8 layouts: per-channel weights with dynamic per-token activations
    (FP8_DYNAMIC), or with `static` per-tensor weights and a per-tensor `input_scale` (FP8)."""
    import torch

    from atom_models.testing import (
        fp8_channel_quantize,
        fp8_tensor_quantize,
        write_quantized_checkpoint,
    )

    def quantize(name, tensor):
        q, scale = (fp8_tensor_quantize if static else fp8_channel_quantize)(tensor)
        out = {name: q, name.replace(".weight", ".weight_scale"): scale}
        if static:
            out[name.replace(".weight", ".input_scale")] = torch.tensor([0.05])
        return out

    float8 = {"num_bits": 8, "type": "float", "symmetric": True}
    weights = {**float8, "strategy": "tensor" if static else "channel", "dynamic": False}
    acts = {**float8, "strategy": "tensor" if static else "token", "dynamic": not static}
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}
        },
    }
    name = "compressed-fp8-static" if static else "compressed-fp8"
    return write_quantized_checkpoint(tiny_llama(tmp), tmp / name, config, quantize)


def mxfp4_gpt_oss_checkpoint(tmp: Path) -> Path:
    """GPT-OSS's layout: MXFP4 experts (`*_blocks`, `*_scales`), the rest unquantized."""
    from transformers import GptOssConfig

    from atom_models.testing import (
        mxfp4_quantize,
        save_random_checkpoint,
        write_quantized_checkpoint,
    )

    save_random_checkpoint(GptOssConfig(**GPT_OSS), tmp / "gpt-oss", seed=5)

    def quantize(name, tensor):
        # Published GPT-OSS: experts [E, in, out] in bf16; MXFP4 blocks are [E, out, in / 32, 16].
        base = name.removesuffix("_proj")
        blocks, scales = mxfp4_quantize(tensor.transpose(1, 2))
        return {f"{base}_proj_blocks": blocks, f"{base}_proj_scales": scales}

    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                     "model.embed_tokens", "lm_head"]  # fmt: skip
    return write_quantized_checkpoint(
        tmp / "gpt-oss",
        tmp / "gpt-oss-mxfp4",
        {"quant_method": "mxfp4", "modules_to_not_convert": not_converted},
        quantize,
        select=lambda n, t: n.endswith(("experts.gate_up_proj", "experts.down_proj")),
    )


def int_checkpoint(tmp: Path, kind: str, desc_act: bool = False) -> Path:
    """The integer formats of issue 40 on the tiny Llama, packed by `atom_models.testing` as each
    format publishes them: compressed-tensors int-quantized (W8A8: int8 per channel, dynamic int8
    activations per token) and pack-quantized (W4A16, group 32, asymmetric), GPTQ (4 bits, group
    32, `desc_act` or not) and AWQ (GEMM, group 32)."""
    from atom_models import testing

    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    configs = {
        "w8a8": (testing.ct_int8, {}, {
            "quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"], "weights": {**int8, "strategy": "channel"},
                "input_activations": {**int8, "strategy": "token", "dynamic": True}}}}),
        "w4a16": (testing.ct_pack_quantized, dict(group_size=32, symmetric=False), {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group",
                "group_size": 32}}}}),
        "gptq": (testing.gptq_pack, dict(group_size=32, desc_act=desc_act), {
            "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": desc_act, "sym": True,
            "checkpoint_format": "gptq"}),
        "awq": (testing.awq_pack, dict(group_size=32), {
            "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
            "version": "gemm"}),
    }  # fmt: skip
    packer, args, config = configs[kind]

    def quantize(name, tensor):
        module = name.removesuffix(".weight")
        return {f"{module}.{k}": v for k, v in packer(tensor, **args)[0].items()}

    name = f"{kind}-desc-act" if desc_act else kind
    return testing.write_quantized_checkpoint(tiny_llama(tmp), tmp / name, config, quantize)
