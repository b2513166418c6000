"""Triton temperature sampling with one random number per block of the vocabulary, not per token.

``sampling._sample_kernel`` draws Gumbel noise (a Philox draw and two logs) for every token: at
batch 256 over Qwen3's 151,936 tokens that is 39M draws and compute-bound (0.29-0.48 ms on an
H100 against ~26-52 us to read the logits, ATOM issue 17). A draw from softmax(x / T) is the
same distribution in two levels (Gumbel-max is exact at each):

1. the row's vocabulary is cut into blocks of ``BLOCK_V`` tokens; block b has log-mass
   L_b = log sum_{i in b} exp(x_i / T), and argmax_b (L_b + G_b), G_b ~ Gumbel(0, 1) i.i.d., picks
   block b with probability exp(L_b) / sum exp(L): one draw per block;
2. inside the chosen block, argmax_i (x_i / T + G'_i) with fresh noise G' (another Philox key)
   picks token i with probability exp(x_i / T) / exp(L_b).

The product is exp(x_i / T) / sum exp(x / T). Each program walks its chunk once: per block one
max, one sum of exp((x - max) / T) (a second sum of exp(x - max) for the log-sum-exp of the raw
logits when T != 1; at T = 1 it is the same sum) and the greedy argmax; the block with the best
key so far stays in registers, so step 2 runs once per program on registers, with BLOCK_V draws.
Split programs of a row write the same partials as ``_sample_kernel`` (the best key and its
token in place of the best Gumbel draw) and ``sampling._sample_reduce_kernel`` merges them: the
row's best key over all its blocks, and that block's token. Block keys are keyed by the global
block index and token noise by the global column, so the split count does not change a draw.

NaN logits are never drawn nor greedy (as -inf) and make the row's log-prob NaN, as the
per-token kernel; a row of -inf gives token 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
BIG = tl.constexpr(2147483647)  # "no index" (int32 max)


# NOTE: the split count and chunk follow the batch size; not specialized on (a variant compiled in
# the middle of a run otherwise: seen in the H100 throughput benchmark).
@triton.jit(do_not_specialize=["chunk", "num_splits"])
def _block_sample_kernel(
    logits_ptr,
    temperature_ptr,
    seed_ptr,  # [2] int32: the Philox keys of the block keys and of the tokens' noise
    token_ids_ptr,
    logprobs_ptr,
    part_f_ptr,  # [B, S, 4] fp32 partials: max, sum (of exp(x - max)), best raw, best key
    part_i_ptr,  # [B, S, 2] int32 partials: ids of the best raw and of the drawn token
    vocab_size,
    chunk,
    num_splits,
    stride_lb,
    SINGLE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # grid (B, S): program (row, split) walks columns [split * chunk, (split + 1) * chunk)
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, vocab_size)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    greedy = temperature < 1e-5  # vLLM's epsilon, as the reference
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    block_seed = tl.load(seed_ptr)
    token_seed = tl.load(seed_ptr + 1)
    block_base = row.to(tl.int64) * tl.cdiv(vocab_size, BLOCK_V)  # this row's block-key stream
    offs = tl.arange(0, BLOCK_V)
    neg_inf = float("-inf")
    run_max = tl.full([], neg_inf, tl.float32)  # of the raw logits (log-sum-exp)
    run_sum = tl.zeros([], tl.float32)
    best_raw, best_raw_i = tl.full([], neg_inf, tl.float32), tl.zeros([], tl.int32)
    best_key = tl.full([], neg_inf, tl.float32)
    kept = tl.full([BLOCK_V], neg_inf, tl.float32)  # the logits of the best-key block
    kept_start = lo
    nan_seen = tl.zeros([], tl.int1)
    # The next block's load is issued before this block's math: two blocks in flight a program.
    x_next = tl.load(row_ptr + lo + offs, mask=lo + offs < hi, other=neg_inf)
    for start in range(lo, hi, BLOCK_V):
        cols = start + offs
        x = x_next.to(tl.float32)
        x_next = tl.load(row_ptr + cols + BLOCK_V, mask=cols + BLOCK_V < hi, other=neg_inf)
        block_max = tl.max(tl.where(x == x, x, neg_inf), axis=0)  # NaN left out
        if block_max > neg_inf:  # a block of -inf adds nothing and is never drawn
            if block_max > best_raw:  # blocks go left to right: ties keep the lower id
                best_raw = block_max
                best_raw_i = tl.min(tl.where(x == block_max, cols, BIG), axis=0)
            # >= 1: the block's max adds exp(0). A NaN logit makes it NaN: then the sum again
            # without them (rare: a broken model), and no NaN state per lane.
            weights = tl.exp2((x - block_max) * (inv_t * LOG2E))
            mass = tl.sum(weights, axis=0)
            if mass != mass:
                nan_seen = True
                mass = tl.sum(tl.where(x == x, weights, 0.0), axis=0)
            raw_mass = mass
            if inv_t != 1.0:
                raw_mass = tl.sum(tl.exp2((x - block_max) * LOG2E), axis=0)
            new_max = tl.maximum(run_max, block_max)
            run_sum = run_sum * tl.exp2((run_max - new_max) * LOG2E) + raw_mass * tl.exp2(
                (block_max - new_max) * LOG2E
            )
            run_max = new_max
            if not greedy:  # Gumbel(0, 1) noise keyed by the global block: split-invariant
                u = tl.rand(block_seed, block_base + start // BLOCK_V)
                gumbel = -tl.log(-tl.log(tl.maximum(u, 1e-20)))
                key = block_max * inv_t + tl.log(mass) + gumbel
                if key > best_key:
                    best_key = key
                    kept = x
                    kept_start = start
    drawn = tl.zeros([], tl.int32)  # a row of -inf (or a greedy row): token 0
    if best_key > neg_inf:  # the token inside the chosen block
        cols = kept_start + offs
        u = tl.rand(token_seed, row.to(tl.int64) * vocab_size + cols)
        u = tl.maximum(u, 1e-20)  # tl.rand is in [0, 1): log(0) would make an infinite draw
        draw = tl.where(kept > neg_inf, kept * inv_t - tl.log(-tl.log(u)), neg_inf)  # not NaN
        drawn = tl.min(tl.where(draw == tl.max(draw, axis=0), cols, BIG), axis=0)
    # A NaN logit makes the log-sum-exp NaN (the chosen token's log-prob), as the reference's.
    run_sum = tl.where(nan_seen, float("nan"), run_sum)
    if SINGLE:
        token = tl.where(greedy, best_raw_i, drawn)
        chosen = tl.load(row_ptr + token).to(tl.float32)
        tl.store(token_ids_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, chosen - run_max - tl.log(run_sum))
    else:
        part = row.to(tl.int64) * num_splits + split
        tl.store(part_f_ptr + part * 4 + 0, run_max)
        tl.store(part_f_ptr + part * 4 + 1, run_sum)
        tl.store(part_f_ptr + part * 4 + 2, best_raw)
        tl.store(part_f_ptr + part * 4 + 3, best_key)
        tl.store(part_i_ptr + part * 2 + 0, best_raw_i)
        tl.store(part_i_ptr + part * 2 + 1, drawn)


def launch(logits, temperature, seeds, token_ids, logprobs, part_f, part_i, chunk, num_splits,
           block_v: int, num_warps: int) -> None:  # fmt: skip
    """One (row, split) program each; the caller merges the splits (num_splits > 1)."""
    num_seqs, vocab_size = logits.shape
    _block_sample_kernel[(num_seqs, num_splits)](
        logits, temperature, seeds, token_ids, logprobs, part_f, part_i, vocab_size, chunk,
        num_splits, logits.stride(0), SINGLE=num_splits == 1, BLOCK_V=block_v,
        num_warps=num_warps,
    )  # fmt: skip
