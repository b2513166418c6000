"""Shared fixtures: tiny random checkpoints saved by transformers, and a paged-cache driver."""

from __future__ import annotations

import random

import pytest
import torch

from atom_models import set_forward_context
from atom_models.native_attention import PagedAttentionMetadata, bind_kv_cache


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations (HF's 0.02-std init makes every logit nearly zero, which
    would let real bugs hide under an absolute tolerance)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(config) -> (directory, the transformers model in float32, eval mode)."""
    from transformers import AutoModelForCausalLM

    def make(config, seed: int = 0):
        torch.manual_seed(seed)
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        randomize_(hf, seed)
        path = tmp_path_factory.mktemp(type(hf).__name__)
        hf.save_pretrained(path)
        return path, hf.eval()

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
