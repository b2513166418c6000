"""ParallelLMHead: logits are hidden @ W^T over the vocabulary, through atom_kernels.linear or a
host's own GEMM (`logits_gemm`, the vLLM plugin's hook on a CPU)."""

import torch

from atom_models.layers.embedding import ParallelLMHead


def test_logits_default_and_host_gemm():
    g = torch.Generator().manual_seed(0)
    head = ParallelLMHead(37, 16)
    head.weight.data = torch.randn(37, 16, generator=g)
    hidden = torch.randn(5, 16, generator=g)
    expected = hidden @ head.weight.T
    torch.testing.assert_close(head.compute_logits(hidden), expected)
    calls = []

    def host_gemm(x):
        calls.append(x.shape)
        return torch.nn.functional.linear(x, head.weight) * 2  # distinguishable from the default

    head.logits_gemm = host_gemm
    torch.testing.assert_close(head.compute_logits(hidden), expected * 2)
    assert calls == [(5, 16)]
