"""Vocabulary-parallel embedding and LM head: rows of the vocabulary split across ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import atom_kernels
from atom_models.distributed import get_tp_group


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank, self.tp.size
        self.num_embeddings = num_embeddings
        # The last rank's shard may hold padding rows (vocab not divisible by tp_size).
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.num_embeddings, param.shape[1]):
            raise ValueError(
                f"embedding: checkpoint tensor has shape {tuple(loaded.shape)}, "
                f"expected {(self.num_embeddings, param.shape[1])}"
            )
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(mask, input_ids - self.vocab_start, 0)
        y = F.embedding(local_ids, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; may share its weight with the input embedding (tied)."""

    # A host may compute the projection with its own GEMM (x [T, hidden] -> [T, V / tp]): the
    # vLLM plugin on a CPU hands it vLLM's prepacked oneDNN GEMM (atom_vllm_plugin.cpu_gemm).
    logits_gemm = None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.logits_gemm is not None:
            logits = self.logits_gemm(hidden_states)
        else:
            logits = atom_kernels.linear(hidden_states, self.weight)  # [T, V / tp]
        if self.tp_size > 1:
            logits = self.tp.all_gather(logits, dim=-1)
        return logits[..., : self.num_embeddings]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
