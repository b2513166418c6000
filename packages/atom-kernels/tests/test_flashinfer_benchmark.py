"""benchmarks/flashinfer_compare.py without FlashInfer (issue 42): its ATOM half on tiny shapes
on this machine's device, the rows and JSON it writes, and the block table -> FlashInfer pages
conversion its FlashInfer half relies on. FlashInfer itself only runs on the device."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"atom_benchmarks_{name}", BENCHMARKS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCHMARKS))  # it imports kernels.py and flashinfer_cases.py
    try:
        yield _load("flashinfer_compare.py"), sys.modules["flashinfer_cases"]
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_atom_half_runs_and_records_flashinfer_absent(bench, tmp_path):
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("FlashInfer is installed here: this test is of the run without it")
    compare, fcases = bench
    out = tmp_path / "fi.json"
    assert compare.main(["--tiny", "--rounds", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["flashinfer"] == "not installed"
    assert report["versions"]["flashinfer"] is None and report["flashinfer_norm_path"] is None
    assert set(report["versions"]) >= {"torch", "triton", "flashinfer"}
    rows = report["rows"]
    tiny = fcases.TINY
    expected = {
        "decode_attention": len(tiny.decode_heads) * len(tiny.decode_batches)
        * len(tiny.decode_contexts),
        "prefill_attention": len(tiny.prefill),
        "mla_decode": len(tiny.mla_batches) * len(tiny.mla_contexts),
        "rms_norm": len(tiny.tokens),
        "fused_add_rms_norm": len(tiny.tokens),
        "fused_add_rms_norm_": len(tiny.tokens),
        "silu_and_mul": len(tiny.tokens),
        "rotary_embedding": len(tiny.rope_tokens),
        "top_k_top_p_sampling": len(tiny.vocabs) * len(tiny.sample_batches),
    }  # fmt: skip
    assert {op: sum(r["op"] == op for r in rows) for op in expected} == expected
    for r in rows:
        assert r["atom"] == "ok", r
        assert r["flashinfer"] == "not installed"
        assert r["atom_ms"] > 0 and r["flashinfer_ms"] is None and r["fi_speedup"] is None
        assert r["bytes"] > 0
        assert "agree" not in r["check"]  # nothing to agree with
        if r["op"] == "top_k_top_p_sampling":  # ATOM's draws inside top-k, then top-p
            assert r["check"]["atom_in_top_k"] == r["check"]["atom_in_top_p"] == 1.0
        else:
            assert r["check"]["atom_finite"], r
    assert all(r["flops"] > 0 for r in rows if r["op"] == "prefill_attention")


def test_only_selects_groups_and_rejects_unknown(bench, tmp_path):
    compare, _ = bench
    out = tmp_path / "fi.json"
    assert compare.main(["--tiny", "--rounds", "1", "--only", "norm", "--out", str(out)]) == 0
    ops = {r["op"] for r in json.loads(out.read_text())["rows"]}
    assert ops == {"rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_"}
    with pytest.raises(SystemExit):
        compare.main(["--tiny", "--only", "norms", "--out", str(out)])


def test_a_raising_side_becomes_an_error_row(bench):
    compare, fcases = bench

    def broken():
        raise RuntimeError("ninja: build stopped\nsecond line")

    x = torch.randn(3, 8)
    case = fcases.Case("rms_norm", "T=3", broken, None, fcases.close, 48.0)
    row = compare.run_case(case, None, "not installed", 2, "cpu", None)
    assert row["atom"] == "error: RuntimeError: ninja: build stopped"
    assert row["atom_ms"] is None and "check" not in row
    ok = fcases.Case("rms_norm", "T=3", lambda: x * 2, None, fcases.close, 48.0)
    assert compare.run_case(ok, None, "needs CUDA", 2, "cpu", None)["atom_ms"] > 0


@pytest.mark.parametrize("page_size", [16, 1])
def test_flashinfer_pages_name_the_same_tokens_as_the_block_table(bench, page_size):
    _, fcases = bench
    gen = torch.Generator().manual_seed(0)
    seq_lens = torch.tensor([5, 33, 16], dtype=torch.int32)
    block = fcases.BLOCK
    max_blocks = max(math.ceil(n / block) for n in seq_lens.tolist())
    num_blocks = 3 * max_blocks
    block_tables = torch.randperm(num_blocks, generator=gen).int().view(3, max_blocks)
    cache = torch.randn(num_blocks, block, 2, 4, generator=gen)
    m = fcases.fi_pages(block_tables, seq_lens, page_size)
    pages = fcases._pages_view(cache, page_size)
    assert pages.shape[1] == page_size
    assert m["indptr"].dtype == m["indices"].dtype == torch.int32
    for b, n in enumerate(seq_lens.tolist()):
        want = torch.stack([cache[block_tables[b, j // block], j % block] for j in range(n)])
        ids = m["indices"][m["indptr"][b] : m["indptr"][b + 1]].long()
        got = pages[ids].flatten(0, 1)  # whole pages, then the last one's length
        last = int(m["last_page_len"][b])
        assert 1 <= last <= page_size
        got = got[: (len(ids) - 1) * page_size + last]
        torch.testing.assert_close(got, want)


def test_checks_tell_agreement_from_disagreement(bench):
    """The checks a FlashInfer row runs, fed ATOM's own output as the other side, then a wrong one
    (a shifted residual; a draw outside the top-k set)."""
    _, fcases = bench
    gen = torch.Generator().manual_seed(0)
    fused = next(c for c in fcases.norm_cases(fcases.TINY, "cpu", gen) if c.op.startswith("fused"))
    out, residual = fused.atom()
    assert fused.check((out, residual), (out.clone(), residual.clone()))["agree"] is True
    assert fused.check((out, residual), (out.clone(), residual + 1.0))["agree"] is False
    sampling = next(fcases.sampling_cases(fcases.TINY, "cpu", gen))
    drawn = sampling.atom()
    assert sampling.check(drawn, drawn.token_ids.clone())["agree"] is True
    logits = sampling.atom.__defaults__[0]
    worst = logits.argmin(dim=-1)  # never inside the top 50
    result = sampling.check(drawn, worst)
    assert result["agree"] is False and result["flashinfer_in_top_k"] == 0.0
