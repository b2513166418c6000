"""The block pool: chained hashes, reference counts, prefix matches and LRU eviction."""

from __future__ import annotations

from atom_engine.block_manager import BlockManager, hash_block
from atom_engine.detokenizer import IncrementalDetokenizer
from atom_engine.sampling_params import SamplingParams
from atom_engine.scheduler import Scheduler
from atom_engine.sequence import Sequence


class _NoTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(65 + i % 26) for i in ids)


def make_seq(tokens: list[int], **params) -> Sequence:
    p = SamplingParams(**params)
    return Sequence("r", 0, tokens, p, IncrementalDetokenizer(_NoTokenizer(), tokens), 0.0)


def compute(bm: BlockManager, seq: Sequence, num: int) -> None:
    """What a step does to a sequence's cache state: allocate, compute, publish hashes."""
    bm.allocate(seq, num)
    seq.num_computed_tokens += num
    bm.cache_computed_blocks(seq)


def test_hash_chain_depends_on_the_whole_prefix():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(None, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])


def test_prefix_match_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)))  # 3 full blocks
    compute(bm, first, 12)
    assert bm.num_free_blocks == 7

    same = make_seq(list(range(12)))
    bm.match_prefix(same)
    # Only 2 blocks: the whole prompt cached would leave nothing to compute (no logits).
    assert same.block_table == first.block_table[:2] and same.num_computed_tokens == 8
    assert [bm.ref_counts[b] for b in first.block_table] == [2, 2, 1]

    longer = make_seq(list(range(12)) + [99, 98])
    bm.match_prefix(longer)
    assert longer.block_table == first.block_table and longer.num_computed_tokens == 12

    diverging = make_seq([0, 1, 2, 3, 4, 5, 6, 0, 8, 9])
    bm.match_prefix(diverging)
    assert diverging.block_table == first.block_table[:1]


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a, 5)  # blocks: [1,2] [3,4] [5] (partial)
    table = list(a.block_table)
    bm.release(a)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    # The partial (unhashed) block is reused first; the hashed ones survive one allocation.
    b = make_seq([7, 7])
    compute(bm, b, 2)
    assert b.block_table == [table[2]]
    again = make_seq([1, 2, 3, 4, 5])
    bm.match_prefix(again)
    assert again.block_table == table[:2]
    bm.release(again)
    bm.release(b)
    # Fill the whole pool with new content: every old hash is evicted.
    c = make_seq(list(range(100, 108)))
    compute(bm, c, 8)
    assert len(bm.cached) == 4
    fresh = make_seq([1, 2, 3, 4, 5])
    bm.release(c)
    bm.match_prefix(fresh)
    assert fresh.block_table == []


def test_prefix_caching_off_and_prompt_logprobs_never_match():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a, 5)
    b = make_seq([1, 2, 3, 4, 5])
    bm.match_prefix(b)
    assert b.block_table == [] and not bm.cached
    bm2 = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    compute(bm2, make_seq([1, 2, 3, 4, 5]), 5)
    c = make_seq([1, 2, 3, 4, 5], prompt_logprobs=1)
    bm2.match_prefix(c)
    assert c.block_table == []


def test_scheduler_decodes_first_then_chunks_prefills_within_budget():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = make_seq(list(range(7))), make_seq(list(range(30)))
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    assert [s is a for s in batch.seqs] == [True, False] and batch.num_tokens == [7, 3]
    for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += num
    a.token_ids.append(5)  # a sampled its first token; b is mid-prefill
    batch = sched.schedule()
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 9]
    assert batch.total_tokens <= 10


def test_scheduler_preempts_newest_when_blocks_run_out():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100)
    old, new = make_seq([1, 2, 3, 4]), make_seq([5, 6, 7])
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()  # 2 + 2 blocks: the pool is full
    for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += num
        seq.token_ids.append(0)
    batch = sched.schedule()  # old needs a third block: new is preempted to make room
    assert batch.seqs == [old] and batch.num_preempted == 1
    assert list(sched.waiting) == [new] and new.num_computed_tokens == 0 and not new.block_table
    assert sched.num_preemptions == 1


def _step(scheduler: Scheduler) -> dict[int, int]:
    """One scheduled step, applied: sequence id -> tokens it computed."""
    batch = scheduler.schedule()
    for seq, num in zip(batch.seqs, batch.num_tokens, strict=True):
        seq.num_computed_tokens += num
        if seq.num_computed_tokens == len(seq):
            seq.token_ids.append(7)  # sampled
    return {seq.seq_id: num for seq, num in zip(batch.seqs, batch.num_tokens, strict=True)}


def test_long_prefill_is_capped_only_while_requests_wait():
    bm = BlockManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64,
                          long_prefill_token_threshold=16)  # fmt: skip
    long = make_seq(list(range(200)))
    scheduler.add(long)
    assert _step(scheduler) == {long.seq_id: 64}  # alone: the whole budget
    short = make_seq([1, 2, 3])
    scheduler.add(short)
    # With a request waiting, the long prefill takes 16 tokens and the short one starts beside it.
    assert _step(scheduler) == {long.seq_id: 16, short.seq_id: 3}
    # The short one decodes behind the long prefill, which stays capped while it does.
    assert _step(scheduler) == {long.seq_id: 16, short.seq_id: 1}
    scheduler.finish(short)
    assert _step(scheduler) == {long.seq_id: 64}  # alone again: no cap
    uncapped = Scheduler(BlockManager(64, 4, False), 8, 64, long_prefill_token_threshold=0)
    long, short = make_seq(list(range(200))), make_seq([1, 2, 3])
    uncapped.add(long)
    _step(uncapped)
    uncapped.add(short)
    assert _step(uncapped) == {long.seq_id: 64}  # no cap: the short one waits behind it
