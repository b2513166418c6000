"""Integer checkpoints through the engine (issue 40): greedy parity with transformers (float32,
CPU).

Each checkpoint is a tiny random one saved by transformers, then quantized:
- compressed-tensors int-quantized (W8A8) and pack-quantized (W4A16) by compressed-tensors itself
  (its `calculate_qparams` and its compressors); the reference is transformers loading the same
  files through compressed-tensors' decompression (`CompressedTensorsConfig(dequantize=True)`).
- AWQ by `atom_models.testing.awq_pack` (AutoAWQ's GEMM packing); the reference is the same files
  converted by compressed-tensors' own `AutoAWQConverter`, then decompressed by transformers.
- GPTQ by `atom_models.testing.gptq_pack` (AutoGPTQ's packing); the reference is the test's own
  dequantized copy, unquantized. `gptqmodel` (transformers' GPTQ backend) is not a dependency:
  it is an sdist built against the installed torch that pulls in datasets, pandas, pyarrow and
  torchao. Built CPU-only once aside, its `TorchLinear.dequantize_weight` matched `gptq_pack`
  (format gptq_v2) to fp16 rounding for 4/8 bits, groups 32/128/-1, desc_act, sym and asym.
"""

from __future__ import annotations

import pytest
import torch

# CPU tests (the CI environment has compressed-tensors); the GPU image does not, and
# `pytest -m gpu packages` there must still collect.
pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.naive_quantized.base import IntQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
from transformers.utils.quantization_config import CompressedTensorsConfig

from atom_engine import LLM, SamplingParams
from atom_models.testing import awq_pack, gptq_pack, write_quantized_checkpoint

TINY = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, max_position_embeddings=512)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, 49152, (k,), generator=gen).tolist() for k in (5, 17, 33, 9)]


def atom_greedy(path, max_tokens: int = 12) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", device="cpu", block_size=8)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def hf_greedy_all(model, greedy_reference, max_tokens: int = 12) -> list[list[int]]:
    return [greedy_reference(model, p, max_tokens, None) for p in prompts()]


def with_weights(src, dst, replaced: dict[str, torch.Tensor]):
    """A copy of the checkpoint `src` at `dst` with some tensors replaced (unquantized)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    tensors.update(replaced)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def ct_quantizer(scheme: QuantizationScheme):
    """quantize(name, weight) -> the module's compressed tensors, by compressed-tensors' own
    observer math (min/max per channel or group) and compressor."""
    args = scheme.weights
    compressor = PackedQuantizationCompressor if args.num_bits < 8 else IntQuantizationCompressor

    def quantize(name, w):
        rows = w.reshape(w.shape[0], -1, args.group_size) if args.group_size else w[:, None]
        scale, zero = calculate_qparams(rows.amin(-1), rows.amax(-1), args)
        state = {"weight": w, "weight_scale": scale}
        if not args.symmetric:
            state["weight_zero_point"] = zero
        module = name.removesuffix(".weight")
        return {f"{module}.{k}": v for k, v in compressor.compress(state, scheme).items()}

    return quantize


def ct_config(scheme: QuantizationScheme, ignore: list[str]) -> dict:
    fmt = "pack-quantized" if scheme.weights.num_bits < 8 else "int-quantized"
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": scheme.model_dump(exclude_none=True)},
        "ignore": ignore,
    }


def ct_reference(path):
    """transformers on the checkpoint, decompressed by compressed-tensors to float32."""
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32
    ).eval()


def quantize_activations_per_token(model, names: list[str]) -> None:
    """W8A8's dynamic activations on the reference: x rounded to int8 per token with
    scale = max|x| / 127 (vLLM's `scaled_int8_quant`, which int-quantized checkpoints are
    published for; compressed-tensors' own fake-quantizer divides by 127.5)."""

    def hook(_, args):
        (x,) = args
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127
        return (torch.round(x / scale).clamp(-128, 127) * scale,)

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in names:
            module.register_forward_pre_hook(hook)


def llama(hidden: int = 64):
    return LlamaConfig(
        **dict(TINY, hidden_size=hidden),
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def qwen3(hidden: int = 128):
    return Qwen3Config(
        **dict(TINY, hidden_size=hidden),
        intermediate_size=2 * hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )


PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_ct_w8a8_llama_matches_transformers(tiny_checkpoint, greedy_reference, tmp_path):
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, type="int", strategy="channel", symmetric=True),
        input_activations=QuantizationArgs(
            num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True
        ),
    )
    src, _ = tiny_checkpoint(llama(), seed=11)
    dst = write_quantized_checkpoint(
        src, tmp_path / "w8a8", ct_config(scheme, ["lm_head"]), ct_quantizer(scheme)
    )
    ref = ct_reference(dst)
    quantize_activations_per_token(ref, PROJ)
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_ct_w4a16_group128_qwen3_matches_transformers(
    symmetric, tiny_checkpoint, greedy_reference, tmp_path
):
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=128, symmetric=symmetric
        ),
    )
    src, _ = tiny_checkpoint(qwen3(), seed=12)
    dst = write_quantized_checkpoint(
        src, tmp_path / "w4a16", ct_config(scheme, ["lm_head"]), ct_quantizer(scheme)
    )
    assert atom_greedy(dst) == hf_greedy_all(ct_reference(dst), greedy_reference)


def test_ct_w4a16_experts_kimi_k2_shape_matches_transformers(
    tiny_checkpoint, greedy_reference, tmp_path
):
    """A tiny DeepSeek-V3 quantized as Kimi-K2-Thinking is: routed experts in 4 bits, group 32,
    symmetric; attention, shared experts and the dense layer's MLP stay in the activation
    dtype (its `ignore` list, verbatim)."""
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
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=32, symmetric=True
        ),
    )
    ignore = [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
    ]
    src, _ = tiny_checkpoint(config, seed=13)

    def is_expert(name, tensor):
        return ".experts." in name and name.endswith("_proj.weight")

    dst = write_quantized_checkpoint(
        src, tmp_path / "kimi", ct_config(scheme, ignore), ct_quantizer(scheme), is_expert
    )
    assert atom_greedy(dst) == hf_greedy_all(ct_reference(dst), greedy_reference)


def packed_checkpoint(src, dst, packer, quant_config: dict, **pack_args):
    """`src` with every projection packed by `packer`; returns (dst, the dequantized weights)."""
    dequantized: dict[str, torch.Tensor] = {}

    def quantize(name, w):
        tensors, dequantized[name] = packer(w, **pack_args)
        module = name.removesuffix(".weight")
        return {f"{module}.{k}": v for k, v in tensors.items()}

    return write_quantized_checkpoint(src, dst, quant_config, quantize), dequantized


@pytest.mark.parametrize("desc_act", [False, True], ids=["groups", "desc_act"])
def test_gptq_matches_dequantized_checkpoint(desc_act, tiny_checkpoint, greedy_reference, tmp_path):
    config = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 32,
        "desc_act": desc_act,
        "sym": True,
        "checkpoint_format": "gptq",
    }
    src, _ = tiny_checkpoint(llama(), seed=14)
    dst, dequantized = packed_checkpoint(
        src, tmp_path / "gptq", gptq_pack, config, bits=4, group_size=32, desc_act=desc_act
    )
    ref_dir = with_weights(src, tmp_path / "ref", dequantized)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


def test_awq_matches_transformers_on_compressed_tensors_conversion(
    tiny_checkpoint, greedy_reference, tmp_path
):
    from compressed_tensors.entrypoints.convert import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    config = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 32,
        "zero_point": True,
        "version": "gemm",
    }
    src, _ = tiny_checkpoint(qwen3(64), seed=15)
    dst, dequantized = packed_checkpoint(src, tmp_path / "awq", awq_pack, config, group_size=32)
    converted = tmp_path / "awq-as-ct"
    convert_checkpoint(
        dst, converted, AutoAWQConverter.from_autoawq_config(config), max_workers=1, device="cpu"
    )
    ref = ct_reference(converted)
    # The public unpacker agrees with the packer's own dequantization, weight for weight (up to
    # its rounding of (q - zero) * scale to the scales' fp16: a wrong nibble is off by a scale).
    for name, w in dequantized.items():
        got = ref.get_parameter(name).float()
        torch.testing.assert_close(got, w, rtol=2**-10, atol=1e-7, msg=f"{name} differs")
    assert atom_greedy(dst) == hf_greedy_all(ref, greedy_reference)


def test_atom_serve_answers_from_an_int4_checkpoint(tiny_checkpoint, tmp_path):
    """The real `atom serve --model <W4A16 dir>` process (loopback HTTP) answers with the
    engine's own greedy text."""
    import json

    from atom_engine.testing import http, start_server, stop_server

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(
            num_bits=4, type="int", strategy="group", group_size=128, symmetric=True
        ),
    )
    src, _ = tiny_checkpoint(qwen3(), seed=16)
    dst = write_quantized_checkpoint(
        src, tmp_path / "int4", ct_config(scheme, ["lm_head"]), ct_quantizer(scheme)
    )
    prompt, params = "The capital of France is", dict(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(str(dst), dtype="float32", device="cpu")
    expected = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs[0].text
    del llm
    flags = ("--dtype", "float32", "--device", "cpu", "--served-model-name", "int4")
    server, url = start_server(dst, tmp_path / "serve.log", *flags)
    try:
        body = json.dumps({"model": "int4", "prompt": prompt, **params}).encode()
        response = http("POST", f"{url}/v1/completions", body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
    finally:
        stop_server(server)
