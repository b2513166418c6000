"""Quantized checkpoints through the engine: greedy parity with transformers (float32, CPU).

Each checkpoint is a tiny random one saved by transformers, quantized by the test in the layout the
format publishes (atom_models.testing), with its `quantization_config` in config.json. The
reference is transformers on the same files, dequantizing (`FineGrainedFP8Config(dequantize=True)`,
`Mxfp4Config(dequantize=True)`), or, for compressed-tensors (whose package is not installed here),
transformers on the checkpoint the test dequantizes itself.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    FineGrainedFP8Config,
    GptOssConfig,
    LlamaConfig,
    Mxfp4Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from atom_engine import LLM, SamplingParams
from atom_models.testing import (
    fp8_block_quantize,
    fp8_channel_quantize,
    fp8_tensor_quantize,
    mxfp4_quantize,
    write_quantized_checkpoint,
)

TINY = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512)


def prompts(n: int = 4, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (int(k),), generator=gen).tolist() for k in (5, 17, 33, 9)[:n]]


def atom_greedy(path, max_tokens: int = 12, **engine_args) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8, **engine_args)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy_all(model, greedy_reference, max_tokens: int = 12) -> list[list[int]]:
    return [greedy_reference(model, p, max_tokens, None) for p in prompts()]


def block_fp8(block, dequantized: dict | None = None):
    """Quantize to block FP8; with `dequantized`, also record each tensor's dequantized values
    there (each block times its scale, DeepSeek's definition: the reference where transformers'
    own dequantizer cannot be one)."""
    bn, bk = block

    def quantize(name, tensor):
        q, scale_inv = fp8_block_quantize(tensor, block)
        if dequantized is not None:
            grid = scale_inv.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            dequantized[name] = q.float() * grid[: q.shape[0], : q.shape[1]]
        return {name: q, name.replace(".weight", ".weight_scale_inv"): scale_inv}

    return quantize


def fp8_config(block) -> dict:
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}


BLOCK_FP8 = {
    # square blocks over a dense Qwen3
    "qwen3": (
        lambda: Qwen3Config(
            **TINY, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32
        ),
        (32, 32),
    ),
    "llama-nonsquare": (
        lambda: LlamaConfig(
            **TINY, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
        ),
        (32, 64),
    ),
    "qwen3-moe": (
        lambda: Qwen3MoeConfig(
            **TINY,
            intermediate_size=128,
            moe_intermediate_size=64,
            num_experts=4,
            num_experts_per_tok=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            norm_topk_prob=True,
        ),
        (32, 32),
    ),
}


@pytest.mark.parametrize("name", BLOCK_FP8, ids=BLOCK_FP8)
def test_block_fp8_matches_transformers(name, tiny_checkpoint, greedy_reference, tmp_path):
    make_config, block = BLOCK_FP8[name]
    src, _ = tiny_checkpoint(make_config(), seed=7)
    dst = write_quantized_checkpoint(src, tmp_path / "fp8", fp8_config(block), block_fp8(block))
    ref = AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


def with_weights(src, dst, replaced: dict[str, torch.Tensor]):
    """A copy of the checkpoint `src` at `dst` with some tensors replaced (unquantized)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    tensors.update(replaced)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_block_fp8_partial_edge_blocks(tiny_checkpoint, greedy_reference, tmp_path):
    """Partial blocks at the bottom and right edges (DeepSeek-V3's 576-row kv_a_proj_with_mqa
    has them): hidden 80 and intermediate 96 in blocks of [32, 64]. transformers' dequantizing
    loader cannot be the reference here: it derives the block from the scale grid
    (rows / grid rows), which is wrong for a partial edge block, so the reference is the
    checkpoint dequantized by the test (each block times its scale, DeepSeek's definition)."""
    config = LlamaConfig(
        **dict(TINY, hidden_size=80),
        intermediate_size=96,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    src, _ = tiny_checkpoint(config, seed=3)
    block = (32, 64)
    dequantized = {}

    quantize = block_fp8(block, dequantized)

    dst = write_quantized_checkpoint(src, tmp_path / "fp8", fp8_config(block), quantize)
    ref_dir = with_weights(src, tmp_path / "ref", dequantized)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


def test_block_fp8_deepseek_v3(tiny_checkpoint, greedy_reference, tmp_path):
    """DeepSeek-V3 in block FP8: MLA projections (kv_a_proj_with_mqa's 40 rows end in a partial
    block of 16, like the real 576 in 128), kv_b_proj dequantized for the absorbed attention,
    routed and shared experts. Reference: the test's own dequantization, unquantized."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(
        **TINY,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
    )
    src, _ = tiny_checkpoint(config, seed=4)
    block = (16, 16)
    dequantized = {}

    quantize = block_fp8(block, dequantized)

    def select(name, tensor):  # every projection, kv_a_proj_with_mqa included
        return tensor.dim() == 2 and "proj" in name.split(".")[-2]

    dst = write_quantized_checkpoint(src, tmp_path / "fp8", fp8_config(block), quantize, select)
    ref_dir = with_weights(src, tmp_path / "ref", dequantized)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


def test_block_fp8_keeps_weights_quantized_and_honours_modules_to_not_convert(
    tiny_checkpoint, tmp_path
):
    from atom_models import load_model

    src, _ = tiny_checkpoint(BLOCK_FP8["qwen3"][0](), seed=7)
    config = dict(fp8_config((32, 32)), modules_to_not_convert=["model.layers.1.mlp.down_proj"])
    dst = write_quantized_checkpoint(
        src,
        tmp_path / "fp8",
        config,
        block_fp8((32, 32)),
        select=lambda n, t: n.endswith("_proj.weight") and "layers.1.mlp.down_proj" not in n,
    )
    model = load_model(dst)
    layer0, layer1 = model.model.layers
    assert layer0.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert tuple(layer0.self_attn.qkv_proj.weight_scale_inv.shape) == (8, 2)  # (4+2+2)*32/32
    assert layer0.mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert layer1.mlp.down_proj.weight.dtype == torch.float32  # left unquantized
    assert model.lm_head.weight.dtype == torch.float32


def test_mxfp4_gpt_oss_matches_transformers(tiny_checkpoint, greedy_reference, tmp_path):
    config = GptOssConfig(
        **TINY,
        intermediate_size=64,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    src, _ = tiny_checkpoint(config, seed=5)

    def quantize(name, tensor):
        # Published GPT-OSS: experts [E, in, out] in bf16; MXFP4 blocks are [E, out, in / 32, 16].
        base = name.removesuffix("_proj")
        blocks, scales = mxfp4_quantize(tensor.transpose(1, 2))
        return {f"{base}_proj_blocks": blocks, f"{base}_proj_scales": scales}

    quant_config = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    dst = write_quantized_checkpoint(
        src,
        tmp_path / "mxfp4",
        quant_config,
        quantize,
        select=lambda n, t: n.endswith(("experts.gate_up_proj", "experts.down_proj")),
    )
    ref = AutoModelForCausalLM.from_pretrained(
        dst, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "modelopt"])
def test_per_tensor_and_per_channel_fp8_match_dequantized_checkpoint(
    strategy, tiny_checkpoint, greedy_reference, tmp_path
):
    config = LlamaConfig(**TINY, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    src, _ = tiny_checkpoint(config, seed=9)
    quantizer = fp8_channel_quantize if strategy == "channel" else fp8_tensor_quantize
    dequantized: dict[str, torch.Tensor] = {}

    def quantize(name, tensor):
        q, scale = quantizer(tensor)
        dequantized[name] = (
            q.float() * scale.reshape(-1, 1) if scale.numel() > 1 else q.float() * scale
        )
        out = {name: q, name.replace(".weight", ".weight_scale"): scale}
        if strategy != "channel":  # static per-tensor activations
            out[name.replace(".weight", ".input_scale")] = torch.tensor([0.05])
        return out

    activations = (
        {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}
        if strategy == "tensor"
        else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    )
    quant_config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "dynamic": False,
                    "symmetric": True,
                },
                "input_activations": activations,
            }
        },
        "ignore": ["lm_head"],
    }
    if strategy == "modelopt":  # NVIDIA ModelOpt FP8: per-tensor weights, static activations
        quant_config = {
            "quant_method": "modelopt",
            "quant_algo": "FP8",
            "exclude_modules": ["lm_head"],
        }
    dst = write_quantized_checkpoint(src, tmp_path / "ct", quant_config, quantize)
    # The reference: the same numbers, stored unquantized.
    ref_dir = with_weights(src, tmp_path / "ref", dequantized)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


BAD_CONFIGS = {
    "awq-gemv": (
        {"quant_method": "awq", "bits": 4, "version": "gemv"},
        r"\(awq\): version 'gemv' \(only 'gemm'\).*gptq",
    ),
    "gptq-marlin": (
        {"quant_method": "gptq_marlin"},
        r"quant_method 'gptq_marlin' is not supported",
    ),
    "block": (
        {"quant_method": "fp8", "weight_block_size": [128]},
        r"block size must be two positive ints, got \[128\]",
    ),
    "int8-ct": (
        {
            "quant_method": "compressed-tensors",
            "config_groups": {
                "g": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}
            },
        },
        r"weight-only int weights in format None",
    ),
    "modelopt-nvfp4": ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, r"quant_algo 'NVFP4'"),
}


@pytest.mark.parametrize("name", BAD_CONFIGS, ids=BAD_CONFIGS)
def test_unsupported_quantization_fails_at_load_naming_it(name, tiny_checkpoint, tmp_path):
    src, _ = tiny_checkpoint(BLOCK_FP8["qwen3"][0](), seed=7)
    quant_config, message = BAD_CONFIGS[name]
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(src), dtype="float32", device="cpu")


def test_atom_serve_answers_from_an_fp8_checkpoint(tiny_checkpoint, tmp_path):
    """The real `atom serve --model <fp8 dir>` process answers with the engine's own greedy text."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    from atom_engine.testing import http

    src, _ = tiny_checkpoint(BLOCK_FP8["qwen3"][0](), seed=7)
    dst = write_quantized_checkpoint(
        src, tmp_path / "fp8", fp8_config((32, 32)), block_fp8((32, 32))
    )
    expected = (
        LLM(str(dst), dtype="float32", device="cpu")
        .generate(
            ["The capital of France is"],
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        )[0]
        .outputs[0]
        .text
    )
    atom = str(Path(sys.executable).parent / "atom")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            atom,
            "serve",
            "--model",
            str(dst),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--served-model-name",
            "fp8",
        ],  # fmt: skip
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "atom serve did not start"
            try:
                if http("GET", f"{base}/health").status_code == 200:
                    break
            except OSError:
                time.sleep(0.5)
        body = {
            "model": "fp8",
            "prompt": "The capital of France is",
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        response = http("POST", f"{base}/v1/completions", json.dumps(body).encode())
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
    finally:
        proc.terminate()
        proc.wait(timeout=60)
