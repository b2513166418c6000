"""The pure helpers of benchmarks/moe.py (the benchmark itself needs a GPU): the INT4 experts'
floor bytes, the random W4A16 experts it times, expert-parallel routing, argument checks."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # moe.py imports its sibling kernels.py
    try:
        spec = importlib.util.spec_from_file_location("atom_benchmarks_moe", BENCHMARKS / "moe.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_wna16_expert_bytes(bench):
    # Kimi-K2's expert: 3 x 7168 x 2048 values, half a byte each, one bf16 scale per 32.
    values = 3 * 7168 * 2048
    assert bench.wna16_expert_bytes(7168, 2048) == values // 2 + values // 16 == 24_772_608
    assert bench.wna16_expert_bytes(64, 32, bits=8, group=64, with_zeros=True) == 6144 + 384
    assert bench.wna16_expert_bytes(7168, 2048) < bench.expert_bytes(7168, 2048) // 3


def test_int4_experts_are_the_layout_with_unit_outputs(bench):
    """The benchmark's random experts pass the op's checks, and an expert's output has about unit
    variance (its scales are right): the torch reference on 64 tokens."""
    import atom_kernels as ak

    g = torch.Generator().manual_seed(0)
    w13, w2, s13, s2 = bench._int4_experts(torch, 2, 512, 256, g)
    assert w13.dtype == torch.int32 and tuple(w13.shape) == (2, 512, 64)
    assert tuple(s13.shape) == (2, 512, 16) and tuple(s2.shape) == (2, 512, 8)
    x = torch.randn(64, 512, generator=g).bfloat16()
    weights = torch.ones(64, 1)
    ids = torch.zeros(64, 1, dtype=torch.int32)
    out = ak.fused_moe(x, w13, w2, weights, ids, quant="wna16", w13_scale=s13, w2_scale=s2)
    gate_up = x.float() @ ak.dequantize_wna16(w13[0], s13[0], None, None, 4).float().T
    assert 0.5 < gate_up.std().item() < 2.0
    assert torch.isfinite(out).all() and out.std().item() > 0.05


def test_ep_routing(bench):
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3]])
    ids = torch.tensor([[0, 5], [7, 2]], dtype=torch.int32)
    w, i = bench.ep_routing(torch, weights, ids, 4, "minus-one")
    assert i.tolist() == [[0, -1], [-1, 2]] and torch.equal(w, weights)
    w, i = bench.ep_routing(torch, weights, ids, 4, "expert-zero")
    assert i.tolist() == [[0, 0], [0, 2]]
    assert torch.equal(w, torch.tensor([[0.6, 0.0], [0.0, 0.3]]))


def test_int4_ep_size_must_divide_kimi_experts(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--int4", "--ep-size", "5", "--out", "/dev/null"])
    assert "does not divide kimi-k2-thinking's 384 experts" in capsys.readouterr().err
