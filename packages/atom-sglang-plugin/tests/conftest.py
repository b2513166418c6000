"""Fixtures for the plugin tests, which run against the real SGLang (`sglang==0.5.23` from PyPI).

These tests run in the environment `ci/host-sglang.sh` builds (SGLang plus the freshly built ATOM
wheels), never in the workspace environment, which has no SGLang: the workspace's pytest run
excludes this directory, and if it is collected anyway without SGLang, nothing here is collected
(`collect_ignore_glob` below) rather than failing or skipping test by test.

SGLang's engine cannot start on these CPU-only machines (its CPU path needs `sgl-kernel` built
from source), so the tests drive SGLang's own pieces directly, in this process, the way its
scheduler and model runner do: `load_plugins()`, `ServerArgs` published as the process's server
arguments, SGLang's `ModelConfig`, its gloo process groups (TP 1), its model loader, its KV-cache
pools, its torch-native attention backend and its `ForwardBatch`.
"""

from __future__ import annotations

import importlib.util
import os
import socket
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    # No SGLang in this environment: these tests belong to ci/host-sglang.sh's environment.
    collect_ignore_glob = ["test_*.py"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A tiny Llama: 2 layers, 4 query heads over 2 KV heads (GQA), head size 16.
TINY_LLAMA = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
)  # fmt: skip


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint directory, the float32 `transformers` model saved there)."""
    from transformers import LlamaConfig

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(**TINY_LLAMA, architectures=["LlamaForCausalLM"])
    reference = save_random_checkpoint(config, path)
    return Path(path), reference


def server_args(model_path, **overrides):
    """SGLang's `ServerArgs` for a CPU run of `model_path` (what `launch_server` flags build)."""
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path=str(model_path), device="cpu", dtype="float32",
                attention_backend="torch_native", skip_tokenizer_init=True)  # fmt: skip
    args.update(overrides)
    return ServerArgs(**args)


@pytest.fixture(scope="session")
def model_config():
    """`model_config(path, **server_args) -> ModelConfig`, built by SGLang from `ServerArgs`."""

    def build(model_path, **overrides):
        from sglang.srt.configs.model_config import ModelConfig

        return ModelConfig.from_server_args(server_args(model_path, **overrides))

    return build


@pytest.fixture(scope="session")
def make_server_args():
    """`make_server_args(path, **overrides) -> ServerArgs` (CPU, float32, torch-native)."""
    return server_args


@pytest.fixture(scope="session")
def sglang_plugins():
    """SGLang's own plugin loading, as every SGLang process does it at start."""
    from sglang.srt.plugins import load_plugins

    load_plugins()


@pytest.fixture(scope="session")
def sglang_runtime(sglang_plugins, tiny_llama):
    """Plugins loaded, server arguments published, and SGLang's process groups up (gloo, TP 1)."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(server_args(tiny_llama[0], model_impl="atom"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    initialize_model_parallel()
