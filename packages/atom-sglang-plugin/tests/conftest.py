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
from types import SimpleNamespace

import pytest
import torch

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


class SglangBatches:
    """A KV-cache pool of SGLang's (MHA or MLA, 512 slots, page size 1), its torch-native backend,
    and `ForwardBatch`es over them, filled the way SGLang's scheduler fills them (one
    request-to-token row per request, slot per token)."""

    def __init__(self, kv_pool) -> None:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.req_to_token = ReqToTokenPool(size=8, max_context_len=128, device="cpu",
                                           enable_memory_saver=False)  # fmt: skip
        self.kv = kv_pool
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                 token_to_kv_pool=self.kv)  # fmt: skip
        self.backend = TorchNativeAttnBackend(runner)
        self.next_slot = 1  # slot 0 is SGLang's padding slot
        self.lens: list[int] = []

    def _slots(self, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return slots

    def extend(self, prompts: list[list[int]]):
        from sglang.srt.model_executor import forward_batch_info as fbi

        lens = [len(p) for p in prompts]
        slots = self._slots(sum(lens))
        starts = [sum(lens[:i]) for i in range(len(lens))]
        for i, n in enumerate(lens):
            self.req_to_token.req_to_token[i, :n] = slots[starts[i] : starts[i] + n].int()
        self.lens = lens
        no_prefix = torch.zeros(len(lens), dtype=torch.int64)
        return fbi.ForwardBatch(
            forward_mode=fbi.ForwardMode.EXTEND, batch_size=len(prompts),
            input_ids=torch.tensor(sum(prompts, [])), req_pool_indices=torch.arange(len(lens)),
            seq_lens=torch.tensor(lens), seq_lens_cpu=torch.tensor(lens), seq_lens_sum=sum(lens),
            out_cache_loc=slots, positions=torch.cat([torch.arange(n) for n in lens]),
            extend_seq_lens=torch.tensor(lens), extend_prefix_lens=no_prefix,
            extend_start_loc=torch.tensor(starts), extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[0] * len(lens), extend_num_tokens=sum(lens),
            capture_hidden_mode=fbi.CaptureHiddenMode.NULL,
        )  # fmt: skip

    def decode(self, tokens: list[int]):
        from sglang.srt.model_executor import forward_batch_info as fbi

        slots = self._slots(len(tokens))
        positions = torch.tensor(self.lens)
        for i, n in enumerate(self.lens):
            self.req_to_token.req_to_token[i, n] = int(slots[i])
        self.lens = [n + 1 for n in self.lens]
        return fbi.ForwardBatch(
            forward_mode=fbi.ForwardMode.DECODE, batch_size=len(tokens),
            input_ids=torch.tensor(tokens), req_pool_indices=torch.arange(len(tokens)),
            seq_lens=torch.tensor(self.lens), seq_lens_cpu=torch.tensor(self.lens),
            seq_lens_sum=sum(self.lens), out_cache_loc=slots, positions=positions,
            capture_hidden_mode=fbi.CaptureHiddenMode.NULL,
        )  # fmt: skip

    def run(self, model, batch):
        """One step as SGLang's model runner takes it: backend metadata, forward context."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self.backend.init_forward_metadata(batch)
        with forward_context(ForwardContext(attn_backend=self.backend), forward_batch=batch):
            return model.forward(batch.input_ids, batch.positions, batch)


@pytest.fixture(scope="session")
def sglang_batches():
    """`sglang_batches(kv_pool) -> SglangBatches` over that pool of SGLang's."""
    return SglangBatches
