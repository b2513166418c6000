"""CPU: a decode-only step's cache write and attention, one layer at a time, with nothing per layer
but the ATen calls.

NOTE: a decode step of SmolLM2-135M (30 layers, 1 thread, this 2-core AMD EPYC, issue 21 session
11) spent ~0.2 ms a layer in the attention op at batch 1, most of it Python: the public ops'
argument checks (or the keys that skip them), the registry look-ups, `per_step`'s memo keys and
the host layout (`_layout`) of every call, ~6-7 ms of a ~50 ms step. A `DecodeStep` is built once
a step from the metadata (by its first layer, checked) and holds what every layer then needs: the
slots to write, the slots to gather, the mask (none where every position is visible: batch 1
without a window cutting it). `attend` is two `index_copy_`, two `index_select` and one
`scaled_dot_product_attention`.

Only for what the cpu backend's `paged_attention` runs as a padded decode batch: every sequence
one query row, no padding rows, a float cache (no fp8 scales), no sinks or soft cap. The caller
(`atom_models.native_host.attention`) falls back to the checked ops for anything else; the torch
reference (`reshape_and_cache` then `paged_attention`) is the oracle in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class DecodeStep:
    """What every layer of one decode-only step shares. B = sequences, L = longest context."""

    write_slots: torch.Tensor  # [B] int64: the cache slot of each sequence's new token
    gather_slots: torch.Tensor  # [B * L] int64: the slot of each (sequence, key position)
    bias: torch.Tensor | None  # [B, 1, 1, L] 0 / -inf, None when every position is visible
    num_seqs: int
    max_seq_len: int

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,  # [B]
        block_tables: torch.Tensor,  # [B, M] int32
        seq_lens: torch.Tensor,  # [B] int32, tokens in the cache after this step
        block_size: int,
        sliding_window: int | None,
    ) -> DecodeStep:
        """The step's plan; ValueError where the metadata is not one decode row per sequence."""
        num_seqs = seq_lens.shape[0]
        if slot_mapping.shape != (num_seqs,) or block_tables.shape[0] != num_seqs:
            raise ValueError(
                f"DecodeStep: {tuple(slot_mapping.shape)} slots, {block_tables.shape[0]} block "
                f"tables and {num_seqs} lengths: a decode step has one of each per sequence"
            )
        write_slots = slot_mapping.long()
        lens = seq_lens.long()[:, None]  # [B, 1]
        if num_seqs == 0 or bool((write_slots < 0).any()) or bool((lens < 1).any()):
            raise ValueError("DecodeStep: every sequence needs a slot and a length >= 1")
        max_seq_len = int(lens.max())
        if max_seq_len > block_tables.shape[1] * block_size:
            raise ValueError(
                f"DecodeStep: a sequence of {max_seq_len} tokens does not fit a block table of "
                f"{block_tables.shape[1]} blocks of {block_size}"
            )
        pos = torch.arange(max_seq_len)[None, :]  # [1, L]
        visible = pos < lens  # [B, L]
        if sliding_window is not None:
            visible &= (lens - 1) - pos < sliding_window
        # An invisible position reads the sequence's last token (written this step, finite), so
        # no garbage (NaN included) of a slot past the table or outside the window reaches the
        # matmuls; the mask gives it probability 0 exactly.
        pos = torch.where(visible, pos, lens - 1)
        blocks = block_tables.long().gather(1, pos // block_size)  # [B, L]
        gather_slots = (blocks * block_size + pos % block_size).reshape(-1)
        bias = None
        if not bool(visible.all()):
            bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            bias = bias[:, None, None, :]
        return cls(write_slots, gather_slots, bias, num_seqs, max_seq_len)

    def attend(
        self,
        query: torch.Tensor,  # [B, H, D]
        key: torch.Tensor,  # [B, Hk, D] this step's keys, written to the cache first
        value: torch.Tensor,  # [B, Hk, Dv]
        key_slots: torch.Tensor,  # [num_blocks * block_size, Hk, D]: the cache's slot view
        value_slots: torch.Tensor,  # [num_blocks * block_size, Hk, Dv]
        scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V, then each sequence's attention over its cache: [B, H, Dv]."""
        # B = sequences, L = longest context, Hk = KV heads, G = query heads per KV head
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads, length = key_slots.shape[1], self.max_seq_len
        group = num_heads // num_kv_heads
        key_slots.index_copy_(0, self.write_slots, key)
        value_slots.index_copy_(0, self.write_slots, value)
        k = key_slots.index_select(0, self.gather_slots).view(num_seqs, length, num_kv_heads, -1)
        v = value_slots.index_select(0, self.gather_slots).view(num_seqs, length, num_kv_heads, -1)
        out = F.scaled_dot_product_attention(
            query.reshape(num_seqs, num_kv_heads, group, head_dim),  # [B, Hk, G, D]
            k.transpose(1, 2),  # [B, Hk, L, D]
            v.transpose(1, 2),  # [B, Hk, L, Dv]
            attn_mask=self.bias,
            scale=scale,
        )  # [B, Hk, G, Dv]
        return out.view(num_seqs, num_heads, -1)
