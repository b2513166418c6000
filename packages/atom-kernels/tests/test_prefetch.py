"""The L2 prefetch (ops/prefetch.py): the chunk table ``l2_spans`` builds, the op's argument
checks and its no-op reference; its Triton kernel compiled for sm_90 (one bulk prefetch a row,
``UBLKPF`` in the SASS); on a GPU, launched eagerly and in a CUDA graph, changing no value."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

import atom_kernels
from atom_kernels.ops.prefetch import CHUNK_BYTES, l2_spans


def _covered(spans: torch.Tensor) -> list[tuple[int, int]]:
    """The table's byte ranges merged where they touch."""
    ranges: list[tuple[int, int]] = []
    for a, n in sorted(spans.tolist()):
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], a + n)
        else:
            ranges.append((a, a + n))
    return ranges


def test_spans_take_each_group_whole_then_a_leading_fraction():
    words = torch.zeros(3000, dtype=torch.int32)  # 12000 bytes
    scales = torch.zeros(75, dtype=torch.bfloat16)  # 150 bytes: not a multiple of 16
    big = torch.zeros(40000, dtype=torch.uint8)
    big_scales = torch.zeros(4000, dtype=torch.uint8)
    first = 12000 + 150
    spans = l2_spans([[words, scales], [big, big_scales]], first + 22000)
    assert spans.dtype == torch.int64 and spans.shape[1] == 2
    assert all(a % 16 == 0 and 0 < n <= CHUNK_BYTES and n % 16 == 0 for a, n in spans.tolist())
    got = _covered(spans)
    # The first group whole, the second half of each tensor (22000 of 44000 bytes).
    for t, nbytes in ((words, 12000), (scales, 150), (big, 20000), (big_scales, 2000)):
        lo, hi = t.data_ptr() & -16, (t.data_ptr() + nbytes + 15) & -16
        assert any(a <= lo and hi <= b for a, b in got), (t.dtype, nbytes)
        # Nothing past the 16-byte piece holding the fraction's last byte.
        assert not any(a < hi + 16 <= b for a, b in got if a <= lo < b)
    assert sum(n for _, n in spans.tolist()) <= first + 22000 + 4 * 32


def test_spans_empty_budget_and_checks():
    t = torch.zeros(64, dtype=torch.float32)
    assert l2_spans([[t]], 0).shape == (0, 2)
    assert l2_spans([[]], 1 << 20).shape == (0, 2)
    with pytest.raises(ValueError, match="not contiguous"):
        l2_spans([[torch.zeros(8, 8).t()]], 1 << 20)


def test_prefetch_checks_and_reference():
    t = torch.zeros(4096, dtype=torch.uint8)
    assert atom_kernels.l2_prefetch(l2_spans([[t]], 4096)) is None  # a hint: nothing back
    assert torch.count_nonzero(t) == 0
    with pytest.raises(ValueError, match="int64"):
        atom_kernels.l2_prefetch(torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="int64"):
        atom_kernels.l2_prefetch(torch.zeros(3, dtype=torch.int64))


def test_triton_launcher_does_nothing_off_sm90():
    pytest.importorskip("triton")
    from atom_kernels.backends.triton import prefetch

    assert not prefetch.supported(torch.device("cpu"))  # the interpreter runs no inline PTX
    prefetch.l2_prefetch(torch.zeros(2, 2, dtype=torch.int64))  # returns without launching


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for sm_90")
@pytest.mark.parametrize("evict_last", [False, True])
def test_kernel_compiles_to_bulk_prefetches_for_sm90(evict_last):
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from atom_kernels.backends.triton import prefetch

    kernel = prefetch._l2_prefetch_kernel
    signature = {"spans_ptr": "*i64", "n": "i32", "BLOCK": "constexpr", "EVICT_LAST": "constexpr"}
    src = ASTSource(kernel, signature, {"BLOCK": prefetch.BLOCK, "EVICT_LAST": evict_last},
                    {(0,): [["tt.divisibility", 16]]})  # fmt: skip
    try:
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=1, num_stages=1))  # fmt: skip
    except FileNotFoundError as exc:  # pragma: no cover - no bundled ptxas here
        pytest.skip(f"no CUDA toolchain for an AOT compile: {exc}")
    ptx = compiled.asm["ptx"]
    assert ptx.count("cp.async.bulk.prefetch.L2.global") == 1  # a row a thread
    assert ("L2::cache_hint" in ptx) == evict_last
    assert ("createpolicy.fractional.L2::evict_last" in ptx) == evict_last
    assert "ld.shared" not in ptx and "bar.sync" not in ptx
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():  # pragma: no cover
        pytest.skip("no bundled cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(cuobjdump), "-sass", cubin.name], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    assert "UBLKPF.L2" in sass


@pytest.mark.gpu
def test_prefetch_on_the_gpu_eager_and_in_a_graph():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from atom_kernels.backends.triton import prefetch

    device = torch.device("cuda")
    w = torch.randn(4096, 1024, device=device, dtype=torch.bfloat16)
    s = torch.randn(4096, 8, device=device, dtype=torch.bfloat16)
    before = (w.clone(), s.clone())
    spans = l2_spans([[w, s]], 5 << 20)
    assert spans.device == device and spans.shape[0] > 0
    assert prefetch.supported(device) == (torch.cuda.get_device_capability()[0] >= 9)
    atom_kernels.l2_prefetch(spans)
    atom_kernels.l2_prefetch(spans, evict_last=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    out = torch.empty_like(w)
    with torch.cuda.graph(graph):
        atom_kernels.l2_prefetch(spans)
        out.copy_(w)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w, before[0]) and torch.equal(s, before[1]) and torch.equal(out, w)
