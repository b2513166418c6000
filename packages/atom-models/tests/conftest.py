"""Shared fixtures: the bundled GGUF file and transformers' load of it, tiny random checkpoints
saved by transformers, and a paged-cache driver."""

from __future__ import annotations

import random

import pytest
import torch

from atom_models import set_forward_context
from atom_models.bundled import smollm2_gguf_path
from atom_models.native_host import PagedAttentionMetadata, bind_kv_cache
from atom_models.testing import save_random_checkpoint


@pytest.fixture(scope="session")
def bundled():
    """The bundled SmolLM2 GGUF file."""
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def reference(smollm2_transformers):
    """transformers' own float32 load of the bundled GGUF file (the root conftest's)."""
    return smollm2_transformers


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(config) -> (directory, the transformers model in float32, eval mode)."""

    def make(config, seed: int = 0):
        path = tmp_path_factory.mktemp(config.model_type)
        return path, save_random_checkpoint(config, path, seed)

    return make


class PagedSession:
    """Drives a model through its paged KV cache like an engine would (random block ids)."""

    def __init__(self, model, num_blocks: int = 64, block_size: int = 4, seed: int = 0) -> None:
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        bind_kv_cache(model, num_blocks, block_size, dtype, "cpu")
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Feed each sequence its next tokens in one mixed batch; returns logits [n, V] per seq."""
        ids, positions, seq_lens, query_lens, tables = [], [], [], [], []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            seq_lens.append(end)
            query_lens.append(len(tokens))
            tables.append(table)
            self.lens[seq] = end
        md = PagedAttentionMetadata.build(seq_lens, query_lens, tables, self.block_size)
        with set_forward_context(md):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
        logits = self.model.compute_logits(hidden)
        out, offset = {}, 0
        for seq, tokens in chunks.items():
            out[seq] = logits[offset : offset + len(tokens)]
            offset += len(tokens)
        return out


@pytest.fixture
def paged_session():
    return PagedSession
