"""EngineConfig validation, and the benchmark path: dummy weights without a tokenizer."""

from __future__ import annotations

import pytest
from transformers import Qwen3Config

from atom_engine import LLM, EngineConfig, SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "float64"),
        ("device", "tpu:0"),
        ("max_model_len", 0),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("block_size", 12),
        ("gpu_memory_utilization", 1.5),
        ("cpu_kv_cache_space", 0),
        ("num_kv_blocks", 0),
        ("load_format", "pt"),
        ("tensor_parallel_size", 0),
        ("data_parallel_size", 0),
    ],
)
def test_invalid_engine_args_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        EngineConfig(**{field: value})


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="not found: no such local path"):
        LLM(str(tmp_path / "nope"))


def test_dummy_weights_without_tokenizer(tmp_path):
    Qwen3Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True, num_kv_blocks=8)
    (out,) = llm.generate(
        {"prompt_token_ids": [1, 2, 3]},
        SamplingParams(max_tokens=5, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].text == ""
    assert all(0 <= t < 1000 for t in out.outputs[0].token_ids)
    with pytest.raises(ValueError, match="need a tokenizer"):
        llm.generate("text", use_tqdm=False)
