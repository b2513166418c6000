"""Configurations ATOM does not support run through vLLM's own implementation, with one WARNING.

- quantization ATOM does not load: a tiny Llama quantized by the test to compressed-tensors INT8
  (W8A8 with asymmetric activations; ATOM's W8A8 is symmetric), and vLLM's online quantization of an
  unquantized checkpoint (`quantization="fp8"`). vLLM's CPU INT8 kernels crash on this CPU and
  its FP8 path needs bfloat16, which crashes it too, so the model is constructed (vLLM's
  `initialize_model`, as its model loader calls it) and not run: the registry still answers
  ATOM's wrapper, and what gets built is vLLM's own `LlamaForCausalLM`, with the WARNING line
  naming the quantization and why ATOM refuses it. Its attention layers get vLLM's own backend
  too (the platform knows the model was handed back). Quantization ATOM loads runs on ATOM's
  model: `test_quantized.py`;
- prompt embeddings (`enable_prompt_embeds=True`): `vllm.LLM` runs end to end through vLLM's own
  model, on the same greedy tokens as with the plugin disabled, with the WARNING line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CAPTURE = """
import json, logging
from atom_vllm_plugin import log
printed = []
class Capture(logging.Handler):
    def emit(self, record):
        printed.append((record.levelname, record.getMessage().removeprefix("ATOM: ")))
log.logger.addHandler(Capture())
def logged():
    return printed + [(logging.getLevelName(level), line) for level, line in log._pending]
def attention(model):
    from vllm.model_executor.layers.attention import Attention
    return sorted({type(m.impl).__module__ + "." + type(m.impl).__qualname__
                   for m in model.modules() if isinstance(m, Attention)})
"""

CONSTRUCT = """
import torch
from vllm import ModelRegistry
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.network_utils import get_open_port

config = EngineArgs(model={model!r}, dtype={dtype!r}, quantization={quantization!r},
                    enforce_eager=True, max_model_len=256).create_engine_config()
registered, _ = ModelRegistry.resolve_model_cls(["LlamaForCausalLM"], config.model_config)
with set_current_vllm_config(config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{{get_open_port()}}")
    ensure_model_parallel_initialized(1, 1)
    with torch.device("cpu"):
        model = initialize_model(config)
from atom_vllm_plugin.stats import counters
print(json.dumps({{
    "registered": registered.__module__ + "." + registered.__qualname__,
    "built": type(model).__module__ + "." + type(model).__qualname__,
    "attention": attention(model),
    "quantization": config.model_config.quantization,
    "counters": counters.snapshot(),
    "logged": logged(),
}}))
"""

GENERATE = """
from vllm import LLM, SamplingParams
llm = LLM(model={model!r}, dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
          block_size=32, enable_prompt_embeds=True, skip_tokenizer_init=True)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompts = [{{"prompt_token_ids": p}} for p in ([5, 6, 7, 8, 9], list(range(20, 60)))]
outs = llm.generate(prompts, params)
((built, impls),) = llm.apply_model(
    lambda m: (type(m).__module__ + "." + type(m).__qualname__, attention(m)))
from atom_vllm_plugin.stats import counters
print(json.dumps({{
    "tokens": [list(o.outputs[0].token_ids) for o in outs],
    "built": built,
    "attention": impls,
    "counters": counters.snapshot(),
    "logged": logged(),
}}))
"""

VLLM_LLAMA = "vllm.model_executor.models.llama.LlamaForCausalLM"
CPU_ATTN_IMPL = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
    )  # fmt: skip
    save_random_checkpoint(config, path)
    return path


@pytest.fixture(scope="module")
def tiny_int8_llama(tiny_llama, tmp_path_factory) -> Path:
    """The tiny Llama in compressed-tensors INT8 W8A8 with asymmetric activations (per-channel
    int8 weights, dynamic per-token int8 activations with a zero point): a format vLLM loads and
    ATOM does not (ATOM's W8A8 is symmetric)."""
    import torch

    from atom_models.testing import write_quantized_checkpoint

    def quantize(name, tensor):
        scale = tensor.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
        q = (tensor / scale).round().clamp(-128, 127).to(torch.int8)
        return {name: q, name.replace(".weight", ".weight_scale"): scale}

    int8 = {"num_bits": 8, "type": "int", "symmetric": True}
    config = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**int8, "strategy": "channel", "dynamic": False},
                "input_activations": {
                    **int8,
                    "symmetric": False,
                    "strategy": "token",
                    "dynamic": True,
                },
            }
        },
    }
    path = tmp_path_factory.mktemp("tiny-llama-int8")
    return write_quantized_checkpoint(tiny_llama, path, config, quantize)


def warnings_naming(result: dict, reason: str) -> list[str]:
    """The plugin's WARNING lines containing `reason`: printed through vLLM's log handler (which
    vLLM's logging configuration gives the plugin's logger), or captured / still held."""
    output = (result["_stdout"] + result["_stderr"]).splitlines()
    printed = [line for line in output if "WARNING" in line and "ATOM:" in line and reason in line]
    held = [
        line
        for level, line in result["logged"]
        if level == "WARNING" and reason in line and not any(line in p for p in printed)
    ]
    return printed + held


# checkpoint fixture, dtype, --quantization -> vLLM's quantization, the reason in the WARNING
UNSUPPORTED_QUANTIZATION = {
    "compressed-tensors-int8": (
        "tiny_int8_llama", "float32", None, "compressed-tensors",
        "a quantized checkpoint (quantization='compressed-tensors': quantization_config "
        "(compressed-tensors): config group 'group_0': asymmetric int8 activations",
    ),
    "online-fp8": (
        "tiny_llama", "bfloat16", "fp8", "fp8",
        "online quantization (quantization='fp8' of an unquantized checkpoint)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", UNSUPPORTED_QUANTIZATION)
def test_unsupported_quantization_builds_vllms_own_model(request, run_python, case) -> None:
    fixture, dtype, quantization, resolved, reason = UNSUPPORTED_QUANTIZATION[case]
    model = str(request.getfixturevalue(fixture))
    code = CONSTRUCT.format(model=model, dtype=dtype, quantization=quantization)
    result = run_python(CAPTURE + code)
    assert result["quantization"] == resolved
    # The registry maps the architecture to ATOM's wrapper; the wrapper built vLLM's own class.
    assert result["registered"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert result["built"] == VLLM_LLAMA
    # vLLM's own model gets vLLM's own attention too (conftest asks for ATOM's on the CPU).
    assert result["attention"] == [CPU_ATTN_IMPL]
    assert result["counters"]["models_built"] == 0
    assert result["counters"]["models_handed_back"] == 1
    lines = warnings_naming(result, reason)
    assert len(lines) == 1 and VLLM_LLAMA in lines[0], result["logged"]


def test_prompt_embeds_run_through_vllms_own_model(run_python, tiny_llama) -> None:
    code = CAPTURE + GENERATE.format(model=str(tiny_llama))
    atom = run_python(code)
    stock = run_python(code, ATOM_DISABLE_VLLM_PLUGIN="1")
    assert atom["built"] == stock["built"] == VLLM_LLAMA
    assert atom["attention"] == stock["attention"] == [CPU_ATTN_IMPL]
    assert atom["tokens"] == stock["tokens"]
    assert atom["counters"]["models_built"] == 0 and atom["counters"]["model_forwards"] == 0
    assert atom["counters"]["models_handed_back"] == 1
    lines = warnings_naming(atom, "prompt embeddings (enable_prompt_embeds=True)")
    assert len(lines) == 1 and VLLM_LLAMA in lines[0], atom["logged"]
    assert not warnings_naming(stock, "ATOM does not support")
