"""Real architectures' shapes (random weights: no downloads on the GPU machine)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def llama3_8b():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=128000,
        eos_token_id=128001,
    )


def qwen3_0_6b():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        bos_token_id=151643,
        eos_token_id=151645,
    )


def qwen3_30b_a3b():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["Qwen3MoeForCausalLM"],
        bos_token_id=151643,
        eos_token_id=151645,
    )


def qwen3_235b_a22b_fp8():
    """Qwen3-235B-A22B-FP8: all 94 layers, block-FP8 weights (about 59 GB a GPU at TP=4)."""
    config = qwen3_30b_a3b()
    config.update(
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
        )
    )
    config.layer_types = ["full_attention"] * 94
    config.quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    return config


def deepseek_v3_4l():
    """DeepSeek-V3 at its real widths and block-FP8 weights, cut to 4 layers: one dense layer
    (the checkpoint has 3) and 3 MoE layers (it has 58), so MoE keeps most of the weights."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=4,
        first_k_dense_replace=1,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        num_attention_heads=128,
        num_key_value_heads=128,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"],
        bos_token_id=0,
        eos_token_id=1,
    )
    config.quantization_config = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    }
    return config


def deepseek_v3_40l():
    """DeepSeek-V3 cut to 40 of its 61 layers: its 3 dense layers and 37 MoE ones (~431 GB of
    block-FP8 weights: fits 4x H200 at TP=4; on 4x H100 cut the layers further)."""
    config = deepseek_v3_4l()
    config.num_hidden_layers = 40
    config.first_k_dense_replace = 3
    return config


def deepseek_v3_24l():
    """DeepSeek-V3 cut to 24 layers (3 dense, 21 MoE; ~245 GB of block-FP8 weights): the 4x H100
    form of `deepseek_v3_40l` (78 GiB a card)."""
    config = deepseek_v3_40l()
    config.num_hidden_layers = 24
    return config


def llama3_8b_w4a16():
    """Llama-3-8B in compressed-tensors pack-quantized W4A16 (llm-compressor's W4A16 scheme:
    4-bit symmetric weights, group 128, every linear layer but the LM head)."""
    config = llama3_8b()
    config.quantization_config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 128,
                },
            }
        },
        "ignore": ["lm_head"],
    }
    return config


def llama3_8b_w8a8():
    """Llama-3-8B in compressed-tensors int-quantized W8A8 (llm-compressor's W8A8 scheme: int8
    weights per channel, int8 activations per token, dynamic)."""
    config = llama3_8b()
    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    config.quantization_config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {**int8, "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }
    return config


SHAPES = {
    "llama3-8b": llama3_8b,
    "llama3-8b-w4a16": llama3_8b_w4a16,
    "llama3-8b-w8a8": llama3_8b_w8a8,
    "qwen3-0.6b": qwen3_0_6b,
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "deepseek-v3-4l": deepseek_v3_4l,
    "deepseek-v3-40l": deepseek_v3_40l,
    "deepseek-v3-24l": deepseek_v3_24l,
    "qwen3-235b-a22b-fp8": qwen3_235b_a22b_fp8,
}


# Tiny stand-ins of the same architectures for smoke runs of the scripts on a CPU.
SMOKE_SHAPES = {
    "llama3-8b": dict(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=2048,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "deepseek-v3-4l": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        n_routed_experts=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        q_lora_rank=128,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=2048,
    ),
    "qwen3-235b-a22b-fp8": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=2048,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "qwen3-30b-a3b": dict(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        vocab_size=2048,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


SMOKE_SHAPES["llama3-8b-w4a16"] = SMOKE_SHAPES["llama3-8b-w8a8"] = SMOKE_SHAPES["llama3-8b"]
# The 40-layer cut's stand-in: the 4-layer one's, its first layer dense as there.
SMOKE_SHAPES["deepseek-v3-40l"] = {**SMOKE_SHAPES["deepseek-v3-4l"], "first_k_dense_replace": 1}
SMOKE_SHAPES["deepseek-v3-24l"] = SMOKE_SHAPES["deepseek-v3-40l"]


def shape_config(name: str, smoke: bool = False):
    """The config of shape `name`, or with `smoke` its tiny stand-in (rebuilt, so fields derived
    from the layer count, such as layer_types, follow it)."""
    config = SHAPES[name]()
    if smoke:
        fields = config.to_dict()
        for key in ("layer_types", *SMOKE_SHAPES[name]):  # an aliased field by its stored name
            fields.pop(config.attribute_map.get(key, key), None)
        fields.update(SMOKE_SHAPES[name])
        config = type(config)(**fields)
        quant = getattr(config, "quantization_config", None)
        if quant and quant.get("weight_block_size"):
            # 32-wide blocks: the tiny widths still split over 4 ranks at block boundaries
            config.quantization_config = {**quant, "weight_block_size": [32, 32]}
    return config


def config_dir(
    name: str, tokenizer_dir: str | None = None, out: str | None = None, smoke: bool = False
) -> str:
    """A directory with config.json for `name` (for load_format='dummy').

    With `tokenizer_dir`, its tokenizer files are copied in and the vocabulary is cut to the
    tokenizer's size, so a server can take text prompts (the serving benchmark).
    """
    import shutil

    path = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"atom-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    config = shape_config(name, smoke)
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config.vocab_size = len(tokenizer)
        config.eos_token_id = tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id
        for f in Path(tokenizer_dir).iterdir():
            shutil.copy(f, path / f.name)
    config.save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    import sys

    print(config_dir(sys.argv[1], *sys.argv[2:]))
