"""The optional FlashInfer kernels (backends/flashinfer): when they are used, and, on a GPU with
``flashinfer`` installed (the device runs, benchmarks/README.md "FlashInfer on the device"), that
its sampler draws what the torch reference draws."""

import importlib.util

import pytest
import torch

from atom_kernels.backends import flashinfer
from atom_kernels.backends.torch import sampling as reference
from atom_kernels.testing import assert_close, assert_equal

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


@pytest.mark.parametrize(
    ("setting", "expected"),
    [(None, False), ("auto", False), ("0", False), ("sample", True), ("rms_norm", False),
     ("rms_norm, sample", True)],
)  # fmt: skip
def test_the_switch_picks_the_measured_ops(monkeypatch, setting, expected):
    """`auto` takes only MEASURED_FASTER (sampling lost in the engine: not in it; MLA decode
    won there, at some shapes: test_flashinfer_mla.py); named ops are taken when asked."""
    if setting is None:
        monkeypatch.delenv("ATOM_FLASHINFER", raising=False)
    else:
        monkeypatch.setenv("ATOM_FLASHINFER", setting)
    assert flashinfer.wanted("sample") is expected
    assert not flashinfer.wanted("fused_moe") or setting not in (None, "auto")
    assert flashinfer.wanted("mla_decode") is (setting in (None, "auto"))


def test_cpu_tensors_never_take_flashinfer():
    assert not flashinfer.use("sample", torch.zeros(2, 8))


needs_flashinfer = pytest.mark.skipif(not HAS_FLASHINFER, reason="flashinfer is not installed")


def _rows(rows, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * 2).cuda()
    temperature = (torch.rand(rows, generator=g) + 0.5).cuda()
    temperature[3] = 0.0  # greedy
    top_k = torch.randint(1, 40, (rows,), generator=g, dtype=torch.int32).cuda()
    top_k[::5] = 0  # off
    top_p = (torch.rand(rows, generator=g) * 0.8 + 0.2).cuda()
    top_p[::4] = 1.0
    return logits, temperature, top_k, top_p


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_draws_stay_in_the_reference_set_with_raw_logprobs(dtype):
    from atom_kernels.backends.flashinfer.sampling import filtered_sample

    logits, temperature, top_k, top_p = _rows(64, 32000, seed=0)
    logits = logits.to(dtype)
    temp = torch.where(temperature > 0, temperature, 1.0)
    tempered = logits.float() / temp[:, None]
    kept = reference.apply_top_k_top_p_min_p(tempered, top_k, top_p, None)
    # The reference's set closed over ties: FlashInfer keeps every token tied with the last one
    # kept, where the reference's top-p cuts a tie by sorted position (bf16 logits tie often).
    allowed = tempered >= kept.masked_fill(torch.isinf(kept), float("inf")).amin(-1, keepdim=True)
    raw = torch.log_softmax(logits.float(), dim=-1)
    for _ in range(4):
        ids, logprobs = filtered_sample(logits, temperature, top_k, top_p)
        assert ids.dtype == torch.int64
        assert bool(allowed.gather(1, ids[:, None]).all()), "a draw outside top-k / top-p (+ ties)"
        assert int(ids[3]) == int(logits[3].float().argmax()), "a greedy row is not the argmax"
        assert_close(logprobs, raw.gather(1, ids[:, None]).squeeze(1), atol=1e-4, rtol=1e-4,
                     name="raw log-probs")  # fmt: skip


@pytest.mark.gpu
@needs_flashinfer
def test_draw_frequencies_follow_the_reference_distribution():
    """20,000 draws of one row (top-k 6, top-p 0.8 over 10 tokens): frequencies within 0.02 of
    the reference's filtered softmax, token by token."""
    from atom_kernels.backends.flashinfer.sampling import filtered_sample

    torch.manual_seed(0)
    n = 20000
    row = torch.tensor([2.0, 1.8, 1.5, 1.4, 1.0, 0.9, 0.8, 0.2, -1.0, -2.0], device="cuda")
    logits = row.expand(n, -1).contiguous()
    temperature = torch.full((n,), 0.9, device="cuda")
    top_k = torch.full((n,), 6, dtype=torch.int32, device="cuda")
    top_p = torch.full((n,), 0.8, device="cuda")
    expected = torch.softmax(
        reference.apply_top_k_top_p_min_p(logits[:1] / 0.9, top_k[:1], top_p[:1], None), -1
    )[0]
    ids, _ = filtered_sample(logits, temperature, top_k, top_p)
    freq = torch.bincount(ids, minlength=10).float() / n
    assert_equal(freq[expected == 0], torch.zeros_like(freq[expected == 0]), name="filtered out")
    assert float((freq - expected).abs().max()) < 0.02, (freq.tolist(), expected.tolist())


@pytest.mark.gpu
@needs_flashinfer
def test_the_engine_sampler_takes_flashinfer_for_top_k_top_p_rows(monkeypatch):
    """ATOM_FLASHINFER=sample: the Triton backend's sample op sends unseeded top-k / top-p rows to
    FlashInfer (its log line is written once), inside the filtered set."""
    from atom_kernels.backends.triton import custom_ops

    monkeypatch.setenv("ATOM_FLASHINFER", "sample")
    monkeypatch.setattr(flashinfer, "_LOGGED", set())
    logits, temperature, top_k, top_p = _rows(16, 4096, seed=1)
    out = custom_ops.sample_op(logits, temperature, top_k, top_p, None, None, 2)
    assert "sample" in flashinfer._LOGGED
    temp = torch.where(temperature > 0, temperature, 1.0)
    allowed = torch.isfinite(
        reference.apply_top_k_top_p_min_p(logits / temp[:, None], top_k, top_p, None)
    )
    assert bool(allowed.gather(1, out.token_ids[:, None]).all())
    assert_close(out.top_logprobs, torch.log_softmax(logits, -1).topk(2, dim=-1).values,
                 atol=1e-5, rtol=1e-5, name="top log-probs")  # fmt: skip
