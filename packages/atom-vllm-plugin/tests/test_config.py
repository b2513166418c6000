"""VllmConfig -> AtomVllmConfig, one test per field, on configs vLLM itself builds from its
engine arguments (the same path `vllm serve` flags take)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from atom_vllm_plugin.config import AtomVllmConfig


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    from transformers import LlamaConfig

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    save_random_checkpoint(config, path)
    return path


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> Path:
    from transformers import MixtralConfig

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-mixtral")
    config = MixtralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=1024,
    )  # fmt: skip
    save_random_checkpoint(config, path)
    return path


def translate(model: Path, **engine_args) -> AtomVllmConfig:
    from vllm.engine.arg_utils import EngineArgs

    args = {"dtype": "float32", "enforce_eager": True, **engine_args}
    vllm_config = EngineArgs(model=str(model), **args).create_engine_config()
    return AtomVllmConfig.from_vllm_config(vllm_config)


def test_model(tiny_llama) -> None:
    assert translate(tiny_llama).model == str(tiny_llama)


@pytest.mark.parametrize(
    ("dtype", "expected"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_dtype(tiny_llama, dtype, expected) -> None:
    assert translate(tiny_llama, dtype=dtype).dtype == expected


def test_device(tiny_llama) -> None:
    assert translate(tiny_llama).device == "cpu"


def test_max_model_len(tiny_llama) -> None:
    assert translate(tiny_llama).max_model_len == 1024  # the checkpoint's context
    assert translate(tiny_llama, max_model_len=300).max_model_len == 300


def test_max_num_seqs(tiny_llama) -> None:
    assert translate(tiny_llama, max_num_seqs=7).max_num_seqs == 7


def test_max_num_batched_tokens(tiny_llama) -> None:
    config = translate(tiny_llama, max_num_batched_tokens=333)
    assert config.max_num_batched_tokens == 333


def test_block_size(tiny_llama) -> None:
    assert translate(tiny_llama, block_size=64).block_size == 64


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_kv_cache_dtype(tiny_llama, kv_cache_dtype) -> None:
    assert translate(tiny_llama, kv_cache_dtype=kv_cache_dtype).kv_cache_dtype == kv_cache_dtype


def test_tensor_parallel_size(tiny_llama) -> None:
    assert translate(tiny_llama).tensor_parallel_size == 1
    assert translate(tiny_llama, tensor_parallel_size=2).tensor_parallel_size == 2


def test_expert_parallel(tiny_moe) -> None:
    assert translate(tiny_moe).enable_expert_parallel is False
    assert translate(tiny_moe, enable_expert_parallel=True).enable_expert_parallel is True


@pytest.mark.parametrize("enabled", [True, False])
def test_prefix_caching(tiny_llama, enabled) -> None:
    config = translate(tiny_llama, enable_prefix_caching=enabled)
    assert config.enable_prefix_caching is enabled


def test_gpu_memory_utilization(tiny_llama) -> None:
    assert translate(tiny_llama, gpu_memory_utilization=0.5).gpu_memory_utilization == 0.5


def test_summary_names_every_field(tiny_llama) -> None:
    summary = translate(tiny_llama, max_num_seqs=7).summary()
    for part in ("dtype=float32", "max_num_seqs=7", "block_size=", "tp=1", "prefix_caching="):
        assert part in summary


def vllm_config(model: Path, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    args = {"dtype": "float32", "enforce_eager": True, **engine_args}
    return EngineArgs(model=str(model), **args).create_engine_config()


@pytest.mark.parametrize(
    ("engine_args", "reason"),
    [
        # The wrapper declares vLLM's SupportsPP, so vLLM's config check lets vLLM's own model
        # (which the wrapper builds instead) take the pipeline stages.
        ({"pipeline_parallel_size": 2}, "pipeline parallelism (pipeline_parallel_size=2)"),
        ({"enable_prompt_embeds": True}, "prompt embeddings (enable_prompt_embeds=True)"),
        ({"enable_lora": True}, "LoRA adapters (enable_lora=True)"),
    ],
)
def test_unsupported_options_are_named_and_refused(tiny_llama, engine_args, reason) -> None:
    from atom_vllm_plugin.config import unsupported_reason

    config = vllm_config(tiny_llama, **engine_args)
    assert unsupported_reason(config) == reason
    # Building ATOM's model directly is refused; the wrapper never gets here (test_fallback.py).
    with pytest.raises(ValueError, match="do not support .*ATOM_DISABLE_VLLM_PLUGIN=1"):
        AtomVllmConfig.from_vllm_config(config)


def test_supported_configuration_has_no_reason(tiny_llama) -> None:
    from atom_vllm_plugin.config import unsupported_reason

    assert unsupported_reason(vllm_config(tiny_llama)) is None
