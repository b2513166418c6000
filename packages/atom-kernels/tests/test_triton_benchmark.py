"""The pure helpers of benchmarks/kernels.py (the benchmark itself needs a GPU): FLOP and byte
counts of attention, rates, roofline fractions, the table. Importing it must not need a GPU or
import triton."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[3] / "benchmarks" / "kernels.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("atom_benchmarks_kernels", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_import_needs_no_gpu_and_no_triton():
    # A fresh interpreter: loading the module must not import torch, triton or the backend.
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('k', {str(PATH)!r}); "
        "m = importlib.util.module_from_spec(spec); sys.modules['k'] = m; "
        "spec.loader.exec_module(m); "
        "print(sorted({'torch', 'triton'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_causal_pairs(bench):
    # 3 new rows over a 5-token sequence: positions 2, 3, 4 see 3, 4, 5 keys.
    assert bench.causal_pairs(3, 5) == 12
    assert bench.causal_pairs(4, 4) == 10  # a full prefill: 4 * 5 / 2
    assert bench.causal_pairs(4, 4, window=2) == 1 + 2 + 2 + 2
    assert bench.causal_pairs(1, 8192) == 8192  # a decode row sees its whole context


def test_attention_counts(bench):
    # Llama-3-8B prefill of 2048 tokens: 2 matmuls x 2 FLOPs x pairs x heads x D.
    pairs = 2048 * 2049 // 2
    assert bench.attention_flops([2048], [2048], 32, 128, 128) == 2.0 * pairs * 32 * 256
    # Decode: the KV cache dominates; q and out are one row per sequence.
    nbytes = bench.attention_bytes([1, 1], [1000, 3000], 32, 8, 128, 2, 2)
    assert nbytes == 4000 * 8 * 2 * 128 * 2 + 2 * 2 * 32 * 128 * 2


def test_rates_and_fraction(bench):
    memory = bench.Result("rms_norm", "x", "triton", ms=2.0, ms_graph=1.0, bytes=3e9)
    assert bench.rate(memory) == ("GB/s", pytest.approx(3000.0))  # graph time preferred
    assert bench.roofline_fraction(memory, 3000.0, 800.0) == pytest.approx(1.0)
    compute = bench.Result("paged_attention", "x", "sdpa", ms=1.0, flops=4e11)
    assert bench.rate(compute) == ("TFLOP/s", pytest.approx(400.0))
    assert bench.roofline_fraction(compute, 3000.0, 800.0) == pytest.approx(0.5)


def test_format_table(bench):
    table = bench.format_table(
        [
            {"op": "rms_norm", "ms": 0.0123456, "ms_graph": None},
            {"op": "x", "ms": 1.5, "ms_graph": 2.0},
        ]
    )
    lines = table.splitlines()
    assert lines[0].split() == ["op", "ms", "ms_graph"]
    assert lines[2].split() == ["rms_norm", "0.01235", "-"]
    assert bench.format_table([]) == ""
