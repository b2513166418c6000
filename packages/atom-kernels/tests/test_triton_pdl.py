"""Programmatic dependent launch (``backends/triton/pdl.py``) changes when a kernel starts, never
what it computes: a Llama-3-8B-shaped decode chain (norm, QKV, norm, gate/up + SiLU, down) run
with PDL gives, bit for bit, the outputs it gives without, eagerly and replayed from a CUDA graph,
many times over (a missing wait would read a half-written activation somewhere)."""

from __future__ import annotations

import pytest
import torch

from atom_kernels.backends.triton import gated_linear, linear, norm, pdl


def _weights(seed: int = 0):
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).cuda()

    hidden, inter = 4096, 14336
    return dict(
        n1=w(hidden, scale=0.1).add_(1),
        qkv=w(6144, hidden, scale=hidden**-0.5),
        n2=w(hidden, scale=0.1).add_(1),
        gate_up=w(2 * inter, hidden, scale=hidden**-0.5),
        down=w(hidden, inter, scale=inter**-0.5),
    )


def _chain(x, residual, p):
    h = norm.rms_norm(x, p["n1"], 1e-5)
    qkv = linear.skinny_linear(h, p["qkv"], None)
    h, residual = norm.fused_add_rms_norm(qkv[:, :4096], residual, p["n2"], 1e-5)
    act = gated_linear.gated_skinny_linear(h, p["gate_up"], None)
    return linear.skinny_linear(act, p["down"], None), residual


@pytest.mark.gpu
@pytest.mark.parametrize("split_k", ["0", "1"])
@pytest.mark.parametrize("rows", [1, 4])
def test_pdl_chain_equals_the_chain_without_it(rows, split_k, monkeypatch):
    if not pdl._supported(torch.cuda.current_device()):
        pytest.skip("programmatic dependent launch needs sm_90+ and a Triton with gdc_wait")
    # Split-K follows PDL by default (another summation order): pinned, so only PDL differs.
    # At 4 rows the 4096-feature GEMMs have 128 column tiles, fewer than the SMs: split-K runs.
    monkeypatch.setattr(linear, "SPLIT_K_SETTING", split_k)
    p = _weights()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 4096, generator=g).to(torch.bfloat16).cuda()
    residual = torch.randn(rows, 4096, generator=g).to(torch.bfloat16).cuda()
    monkeypatch.setattr(pdl, "ENABLED", False)
    want = _chain(x, residual, p)
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.enabled(x.device)
    for _ in range(20):  # eagerly, back to back
        out = _chain(x, residual, p)
        torch.testing.assert_close(out, want, atol=0, rtol=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _chain(x, residual, p)  # compiled before the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _chain(x, residual, p)
    for i in range(50):
        x.copy_(torch.randn(rows, 4096, generator=g).to(torch.bfloat16))
        graph.replay()
        monkeypatch.setattr(pdl, "ENABLED", False)
        expected = _chain(x, residual, p)
        monkeypatch.setattr(pdl, "ENABLED", True)
        torch.testing.assert_close(captured, expected, atol=0, rtol=0, msg=f"replay {i}")
