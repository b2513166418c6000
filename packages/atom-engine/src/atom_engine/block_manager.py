"""The paged KV cache's block pool, with prefix caching.

A full block is keyed by a chained hash of its tokens (xxhash64 over the parent block's hash and the
block's token ids), so equal keys mean equal prefixes. Blocks are shared by reference count. A block
whose count drops to zero goes to the back of the free queue but keeps its hash: until it is handed
out again (evicting it, least recently freed first) a new request with the same prefix revives it.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from atom_engine.sequence import Sequence


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh64()
    h.update((parent_hash if parent_hash is not None else 0).to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # Prefix-cache statistics over prompt tokens looked up.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    # -- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------

    def _full_block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Hashes of the first num_tokens // block_size full blocks of seq (reusing known ones)."""
        hashes = seq.block_hashes
        for i in range(len(hashes), num_tokens // self.block_size):
            chunk = seq.token_ids[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(hash_block(hashes[-1] if hashes else None, chunk))
        return hashes[: num_tokens // self.block_size]

    def match_prefix(self, seq: Sequence) -> None:
        """Attach the longest cached prefix of a new (or preempted) sequence's tokens.

        At least one token is always left to compute, so the step produces logits to sample from.
        """
        assert seq.num_computed_tokens == 0 and not seq.block_table
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return  # prompt log-probs need every prompt position computed
        hits: list[int] = []
        for h in self._full_block_hashes(seq, len(seq) - 1):
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
        for block in hits:
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
        seq.block_table = hits
        seq.num_published_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size

    def record_prefix_lookup(self, seq: Sequence) -> None:
        """Count a newly admitted request's prompt in the hit-rate statistics (once)."""
        if seq.num_output_tokens == 0 and seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
            self.num_queried_tokens += len(seq)
            self.num_hit_tokens += seq.num_computed_tokens

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Publish the hashes of the sequence's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_published_blocks:
            return  # nothing new (a decode inside a block): no per-block walk every step
        hashes = self._full_block_hashes(seq, seq.num_computed_tokens)
        for i in range(seq.num_published_blocks, full):
            block, h = seq.block_table[i], hashes[i]
            if self.block_hash[block] is None:
                self.block_hash[block] = h
                self.cached.setdefault(h, block)
        seq.num_published_blocks = full

    # -- allocation -----------------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return needed - len(seq.block_table) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        while len(seq.block_table) < needed:
            block, _ = self.free.popitem(last=False)  # least recently freed
            old = self.block_hash[block]
            if old is not None:  # evict it from the prefix cache
                if self.cached.get(old) == block:
                    del self.cached[old]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past seq's tokens: those rejected speculative drafts were written to
        (their K/V is garbage; nothing hashed them, so they return to the front of the queue)."""
        keep = self.blocks_needed(len(seq))
        for block in seq.block_table[keep:]:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
                self.free.move_to_end(block, last=False)
        # A new list, not a cut in place: a block table list only ever grows (the decode graphs'
        # staging rewrites a table row only past the length it last wrote of the same list).
        seq.block_table = seq.block_table[:keep]

    def release(self, seq: Sequence) -> None:
        """Drop seq's references; blocks no one uses become free (their hashes kept, LRU)."""
        # Last blocks first: a sequence's tail is the least likely to be shared, so it is evicted
        # before the prefix blocks freed in the same call.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.block_hash[block] is None:
                    self.free[block] = None
                    self.free.move_to_end(block, last=False)  # unhashed: reuse first
                else:
                    self.free[block] = None
        seq.block_table = []
        seq.num_published_blocks = 0
        seq.num_computed_tokens = 0
