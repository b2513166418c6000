"""Shared fixtures: the bundled model (ATOM engine and transformers) and tiny random checkpoints."""

from __future__ import annotations

import os

import pytest
import torch

from atom_models.bundled import smollm2_gguf_path
from atom_models.gguf_file import gguf_tokenizer
from atom_models.testing import save_random_checkpoint


@pytest.fixture(scope="session")
def bundled_tokenizer():
    # The GPU machine lacks the bundled model's package (its 94 MiB GGUF is over what a device
    # call carries): there ATOM_TEST_TOKENIZER names a directory its tokenizer was saved to
    # (`benchmarks/run_gpu.sh` and benchmarks/README.md: .bench_assets/tokenizer).
    saved = os.environ.get("ATOM_TEST_TOKENIZER")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)
    return gguf_tokenizer(smollm2_gguf_path())


@pytest.fixture(scope="session")
def smollm2_llm():
    """ATOM's engine on the bundled SmolLM2 (float32, CPU), shared by the session's tests."""
    from atom_engine import LLM

    return LLM(dtype="float32", device="cpu", max_num_batched_tokens=256)


@pytest.fixture(scope="session")
def smollm2_engine():
    """An AsyncEngine on the bundled SmolLM2 (float32, CPU, 1024-token context) shared by the
    server tests whose engine settings do not matter; each module serves its own app on it.

    NOTE: building an engine reads the GGUF file for its config, tokenizer and weights: 26 s
    of CPU time (264 s of wall time at load 18 on the 2-core machine), so modules share this one
    instead of each building its own."""
    from atom_engine import EngineConfig
    from atom_engine.server.async_engine import AsyncEngine

    config = EngineConfig(
        dtype="float32", device="cpu", max_model_len=1024, cpu_kv_cache_space=0.25
    )
    engine = AsyncEngine.from_config(config)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_transformers):
    """transformers' own load of the same GGUF file: the reference (the root conftest's)."""
    return smollm2_transformers


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, bundled_tokenizer):
    """tiny_checkpoint(config) -> (directory with weights + tokenizer, transformers model)."""

    def make(config, seed: int = 0):
        path = tmp_path_factory.mktemp(config.model_type)
        return path, save_random_checkpoint(config, path, seed, tokenizer=bundled_tokenizer)

    return make


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
    """transformers' greedy generation of one prompt (no padding), new tokens only."""
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=eos if eos is not None else 0,
        min_new_tokens=0 if eos is not None else max_new_tokens,
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="session")
def greedy_reference():
    return hf_greedy
