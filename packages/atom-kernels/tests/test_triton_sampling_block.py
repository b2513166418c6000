"""The block sampler (``sampling_block.py``: a Gumbel draw per block of tokens, then per token
inside the drawn block) against softmax(logits / T): frequencies of many draws of the same rows
by a chi-square test, at several temperatures, split counts and block widths; one-hot rows at
block and chunk edges; -inf and NaN rows."""

import math

import pytest
import torch

from atom_kernels.testing import assert_close, assert_equal


def _logits(rows, vocab, seed, dtype=torch.float32, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, vocab, generator=g) * spread).to(dtype)


def _chi2_critical(df: int, z: float = 5.0) -> float:
    """The chi-square quantile at a normal z-score (Wilson-Hilferty): z = 5, p ~ 3e-7."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def assert_follows(ids: torch.Tensor, probs: torch.Tensor, name: str) -> None:
    """``ids`` [N] are N draws from ``probs`` [V]: no draw of a 0-probability token, and a
    chi-square test over the tokens (tokens of expected count < 5 pooled into one cell)."""
    ids, probs = ids.cpu(), probs.double().cpu()
    draws = ids.numel()
    assert bool(((ids >= 0) & (ids < probs.numel())).all()), f"{name}: ids out of range"
    counts = torch.bincount(ids, minlength=probs.numel()).double()
    never = (probs == 0) & (counts > 0)
    assert not bool(never.any()), f"{name}: drew 0-probability tokens {never.nonzero().tolist()}"
    expected = probs * draws
    big = expected >= 5
    cells_obs = torch.cat([counts[big], counts[~big].sum()[None]])
    cells_exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = cells_exp > 0
    cells_obs, cells_exp = cells_obs[keep], cells_exp[keep]
    stat = float(((cells_obs - cells_exp) ** 2 / cells_exp).sum())
    df = max(1, cells_exp.numel() - 1)
    worst = ((cells_obs - cells_exp).abs() / cells_exp.sqrt()).argmax()
    assert stat < _chi2_critical(df), (
        f"{name}: chi-square {stat:.1f} over {df} degrees of freedom (critical "
        f"{_chi2_critical(df):.1f}); worst cell observed {cells_obs[worst]:.0f} "
        f"expected {cells_exp[worst]:.1f}"
    )


def _num_draws(backend, interpreted: int) -> int:
    """Draws of a statistical test: few under the interpreter (~25 ms a program on the 2-core
    test machine), 20,000 compiled."""
    return interpreted if backend.interpreted else 20000


def _draw(backend, row, draws, temperature, **kwargs):
    logits = row.to(backend.device).expand(draws, row.numel()).contiguous()
    temp = torch.full((draws,), temperature, device=logits.device)
    return backend.sampling.fused_sample(logits, temp, kernel="block", **kwargs)


_GPU = pytest.mark.gpu  # the parameters only a compiled run affords (many draws each)


@pytest.mark.parametrize(
    "temperature,num_splits",
    [(0.5, 2), pytest.param(1.0, 1, marks=_GPU), pytest.param(0.5, 1, marks=_GPU),
     pytest.param(1.7, 3, marks=_GPU), pytest.param(1.0, 4, marks=_GPU)],
)  # fmt: skip
@pytest.mark.interpreter_slow
def test_draws_follow_the_tempered_softmax(triton_backend, temperature, num_splits):
    """20 tokens over blocks of 8 (two full, one tail of 4), the row's mass spread unevenly
    over the blocks: the block draw and the draw inside the block both show."""
    torch.manual_seed(11)
    row = _logits(1, 20, seed=2, spread=1.0)[0]
    row[8:16] -= 1.5  # the middle block holds little mass
    row[5] = float("-inf")  # a masked token is never drawn
    draws = _num_draws(triton_backend, 300)
    ids, logprobs = _draw(triton_backend, row, draws, temperature, num_splits=num_splits, block_v=8)
    probs = torch.softmax(row.double() / temperature, dim=-1)
    assert_follows(ids, probs, f"T={temperature} splits={num_splits}")
    raw = torch.log_softmax(row.double(), dim=-1)[ids.cpu()]
    assert_close(logprobs.cpu().double(), raw, atol=2e-5, rtol=2e-5, name="drawn logprobs")


@pytest.mark.parametrize(
    "temperature,first,last",
    [
        (1.0, [0.0, 0.0, 0.0], math.log(3.0)),  # 3 tokens of weight 1 against one of 3: 1:1
        (0.5, [math.log(2.0)], 0.0),  # 2 ** (1 / 0.5) against 1: 4:1
        pytest.param(1.7, [1.0, -0.5, 0.3, 2.0], 0.5, marks=_GPU),
    ],
)
@pytest.mark.interpreter_slow
def test_mass_between_two_blocks(triton_backend, temperature, first, last):
    """Tokens in the first block against one in the last (tail) block, the rest -inf: the block
    draw weighs each block by its whole tempered mass (not its max, not untempered)."""
    torch.manual_seed(5)
    row = torch.full((70,), float("-inf"))
    row[3 : 3 + len(first)] = torch.tensor(first)
    row[66] = last
    ids, _ = _draw(
        triton_backend, row, _num_draws(triton_backend, 300), temperature, num_splits=2, block_v=16
    )
    probs = torch.softmax(row.double() / temperature, dim=-1)
    assert_follows(ids, probs, f"T={temperature} {first} against {last}")


@pytest.mark.parametrize("block_v,num_splits", [(16, 1), (16, 3), (32, 2)])
def test_one_hot_rows_at_block_and_chunk_edges(triton_backend, block_v, num_splits):
    """A row with one finite logit draws that token (log-prob 0), wherever it sits: the first
    and last column, either side of a block edge and of a chunk edge."""
    vocab = 100
    cols = [0, block_v - 1, block_v, 2 * block_v - 1, 2 * block_v, 48, 63, 64, vocab - 1]
    logits = torch.full((len(cols), vocab), float("-inf"))
    for r, c in enumerate(cols):
        logits[r, c] = 3.0 - r  # any value
    logits = logits.to(triton_backend.device)
    for temperature in (0.0, 0.6, 1.0, 2.5):
        temp = torch.full((len(cols),), temperature, device=logits.device)
        ids, lp = triton_backend.sampling.fused_sample(
            logits, temp, kernel="block", block_v=block_v, num_splits=num_splits
        )
        assert_equal(ids.cpu(), torch.tensor(cols), name=f"one-hot ids T={temperature}")
        assert_close(lp.cpu(), torch.zeros(len(cols)), atol=1e-6, rtol=0, name="log-prob 0")


@pytest.mark.interpreter_slow
def test_dominant_token_beside_small_ones(triton_backend):
    """One token 30 nats above the rest (a sharp distribution) is drawn every time at T = 1,
    from any block; at T = 20 the others show up."""
    rows = _logits(6, 90, seed=8, spread=0.5)
    hot = [0, 15, 16, 47, 80, 89]
    for r, c in enumerate(hot):
        rows[r, c] = 30.0
    logits = rows.to(triton_backend.device)
    ids, _ = triton_backend.sampling.fused_sample(
        logits, torch.ones(6, device=logits.device), kernel="block", block_v=16, num_splits=2
    )
    assert_equal(ids.cpu(), torch.tensor(hot), name="dominant token")
    hot_prob = torch.softmax(rows.double() / 20, -1)[0, 0].item()
    assert hot_prob < 0.3  # so a draw off the hot token is likely
    torch.manual_seed(2)
    ids, _ = _draw(triton_backend, rows[0], _num_draws(triton_backend, 200), 20.0, block_v=16)
    assert_follows(ids, torch.softmax(rows[0].double() / 20, -1), "T=20")


@pytest.mark.interpreter_slow
def test_mixed_temperatures_and_batch(triton_backend):
    """Rows of different temperatures (greedy among them) in one batch, each drawn from its
    own tempered softmax: 3 distinct rows repeated, interleaved."""
    torch.manual_seed(3)
    base = _logits(3, 50, seed=4, spread=1.2)
    temps = torch.tensor([0.0, 0.7, 1.3])
    reps = _num_draws(triton_backend, 150)
    logits = base.repeat(reps, 1).to(triton_backend.device)
    temperature = temps.repeat(reps).to(triton_backend.device)
    ids, logprobs = triton_backend.sampling.fused_sample(
        logits, temperature, kernel="block", block_v=16
    )
    ids = ids.cpu().view(reps, 3)
    assert bool((ids[:, 0] == base[0].argmax()).all()), "greedy row"
    for r in (1, 2):
        probs = torch.softmax(base[r].double() / temps[r].item(), dim=-1)
        assert_follows(ids[:, r], probs, f"row T={temps[r].item()}")
    raw = torch.log_softmax(base.double(), -1).repeat(reps, 1).gather(1, ids.view(-1, 1))
    assert_close(logprobs.cpu().double(), raw.squeeze(1), atol=2e-5, rtol=2e-5, name="logprobs")


def test_all_minus_inf_and_nan_rows(triton_backend):
    """A row of -inf gives token 0 (as the per-token kernel); a NaN logit is never drawn nor
    greedy and makes the row's log-prob NaN; NaN rows draw 0 too."""
    logits = _logits(6, 40, seed=9, spread=0.3)
    logits[0] = float("-inf")
    logits[1] = float("nan")
    logits[2, 17] = float("nan")
    logits[2, 5] = 50.0  # greedy and (almost surely) drawn: the NaN beside it changes nothing
    logits[3, 20:] = float("nan")
    logits[4, 21] = float("nan")
    logits[4, 22] = 80.0
    logits = logits.to(triton_backend.device)
    for temperature in (0.0, 1.0, 0.5):
        temp = torch.full((6,), temperature, device=logits.device)
        for num_splits in (1, 3):
            ids, lp = triton_backend.sampling.fused_sample(
                logits, temp, kernel="block", block_v=16, num_splits=num_splits
            )
            ids, lp = ids.cpu(), lp.cpu()
            assert ids[0] == 0 and ids[1] == 0, ids
            assert ids[2] == 5 and ids[4] == 22, ids
            assert ids[3] < 20, ids
            assert bool(lp[1:5].isnan().all()), lp
            assert bool(lp[5].isfinite()), lp


def test_same_torch_seed_same_draws_across_splits(triton_backend):
    device = triton_backend.device
    logits = _logits(5, 130, seed=6, spread=0.4).to(device)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.0, 3.0], device=device)
    results = []
    for num_splits in (1, 2, 3, 5):
        torch.manual_seed(4)
        results.append(
            triton_backend.sampling.fused_sample(
                logits, temperature, kernel="block", block_v=16, num_splits=num_splits
            )
        )
    for ids, lp in results[1:]:
        assert_equal(ids, results[0][0], name="split draws")
        assert_close(lp, results[0][1], atol=1e-5, rtol=1e-5, name="split logprobs")
    again = triton_backend.sampling.fused_sample(logits, temperature, kernel="block", block_v=16)
    assert not torch.equal(again[0], results[0][0]), "a new call draws new noise"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.interpreter_slow
def test_strided_low_precision_rows(triton_backend, dtype):
    """Rows with a stride (a view into a wider buffer) in 16-bit: the draws follow the softmax
    of the rounded logits."""
    torch.manual_seed(9)
    wide = _logits(1, 64, seed=12, spread=1.5).to(dtype)
    row = wide[0, :45]
    draws = _num_draws(triton_backend, 200)
    buffer = wide.to(triton_backend.device).expand(draws, 64).contiguous()
    logits = buffer[:, :45]
    temp = torch.full((draws,), 0.9, device=logits.device)
    ids, lp = triton_backend.sampling.fused_sample(logits, temp, kernel="block", block_v=16)
    probs = torch.softmax(row.double() / 0.9, dim=-1)
    assert_follows(ids, probs, f"{dtype}")
    raw = torch.log_softmax(row.double(), -1)[ids.cpu()]
    assert_close(lp.cpu().double(), raw, atol=2e-5, rtol=2e-5, name="logprobs")


def test_unknown_kernel_is_refused(triton_backend):
    logits = _logits(2, 10, seed=1).to(triton_backend.device)
    with pytest.raises(ValueError, match="kernel must be one of"):
        triton_backend.sampling.fused_sample(
            logits, torch.ones(2, device=logits.device), kernel="x"
        )


@pytest.mark.gpu
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_gpu_qwen_vocab_distribution(triton_backend, temperature):
    """Compiled, at Qwen3's vocabulary (blocks of 2048 over 75 blocks): 8192 draws of one bf16 row
    whose mass sits on 60 tokens spread over the vocabulary (and a long flat tail), chi-square
    against the tempered softmax, at batch 8192 (one split a row) and across splits."""
    vocab = 151936
    g = torch.Generator().manual_seed(21)
    row = torch.randn(vocab, generator=g) * 0.5 - 4.0
    hot = torch.randperm(vocab, generator=g)[:60]
    row[hot] = torch.randn(60, generator=g) * 0.8 + 4.0
    row[hot[:3]] = float("-inf")
    row[2047], row[2048] = 4.5, 4.5  # either side of a block edge
    probs = torch.softmax(row.double() / temperature, dim=-1)
    torch.manual_seed(0)
    ids, lp = _draw(triton_backend, row.to(torch.bfloat16), 8192, temperature)
    rounded = row.to(torch.bfloat16).double()
    assert_follows(ids, torch.softmax(rounded / temperature, -1), "B=8192")
    raw = torch.log_softmax(rounded, -1)[ids.cpu()]
    assert_close(lp.cpu().double(), raw, atol=1e-4, rtol=1e-4, name="logprobs")
    small = row.expand(8, vocab).contiguous().cuda()
    many = []
    for _ in range(512):  # 8 rows, split over the SMs
        many.append(
            triton_backend.sampling.fused_sample(
                small, torch.full((8,), temperature, device="cuda"), kernel="block"
            )[0]
        )
    assert_follows(torch.cat(many), probs, "B=8 split")


@pytest.mark.gpu
def test_gpu_graph_capture_replays_new_draws(triton_backend):
    """The block sampler in a CUDA graph: each replay draws anew (the Philox keys come from
    torch's generator, captured), greedy rows stay the argmax."""
    logits = _logits(64, 151936, seed=3, spread=0.3).to(torch.bfloat16).cuda()
    temperature = torch.ones(64, device="cuda")
    temperature[:4] = 0
    sample = triton_backend.sampling.fused_sample
    sample(logits, temperature, kernel="block")  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, lp = sample(logits, temperature, kernel="block")
    seen = []
    for _ in range(3):
        graph.replay()
        seen.append(ids.clone())
    torch.cuda.synchronize()
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    for drawn in seen:
        assert_equal(drawn[:4], logits[:4].float().argmax(-1), name="greedy rows")
        assert bool(((drawn >= 0) & (drawn < 151936)).all())
    raw = torch.log_softmax(logits.float(), -1).gather(1, seen[-1][:, None]).squeeze(1)
    assert_close(lp, raw, atol=1e-4, rtol=1e-4, name="logprobs")
