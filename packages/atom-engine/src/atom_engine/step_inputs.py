"""One step's forward inputs as flat token data: what every tensor-parallel rank needs to run the
step, with no sequence objects. Rank 0 builds it from the scheduled batch and sends it to the other
ranks as one int64 array (`pack` / `unpack`: a few KB at batch 64, no pickling)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# What a worker does with a step (the first word of a packed message).
OP_SHUTDOWN, OP_RUN, OP_LAUNCH = 0, 1, 2

_HEADER = 6  # op, tokens, sequences, gathers, sampled rows, prompt-logprob ranges


@dataclass
class StepInputs:
    """B = sequences, T = tokens of the step (B consecutive runs of query_lens[i] tokens)."""

    ids: list[int]  # [T] input ids (a placeholder where `gathers` fills in a sampled id)
    seq_lens: list[int]  # [B] tokens in the cache after this step
    query_lens: list[int]  # [B] tokens computed this step
    tables: list[list[int]]  # [B] block tables
    gathers: list[tuple[int, int]]  # (input row, row of the previous launch's sampled ids)
    sample_rows: list[int]  # rows whose logits are sampled (the last of a finished prompt)
    prompt_rows: list[tuple[int, int]]  # (first row, count) of prompt-logprob logits

    def positions(self) -> list[int]:
        out: list[int] = []
        for seq_len, query_len in zip(self.seq_lens, self.query_lens, strict=True):
            out += range(seq_len - query_len, seq_len)
        return out

    def pack(self, op: int) -> bytes:
        table_lens = [len(t) for t in self.tables]
        header = [
            op,
            len(self.ids),
            len(self.seq_lens),
            len(self.gathers),
            len(self.sample_rows),
            len(self.prompt_rows),
        ]
        parts = [
            header,
            self.ids,
            self.seq_lens,
            self.query_lens,
            table_lens,
            [b for t in self.tables for b in t],
            [x for g in self.gathers for x in g],
            self.sample_rows,
            [x for p in self.prompt_rows for x in p],
        ]
        return np.fromiter(
            (x for part in parts for x in part), dtype=np.int64, count=sum(map(len, parts))
        ).tobytes()

    @staticmethod
    def unpack(data: bytes) -> tuple[int, StepInputs | None]:
        words = np.frombuffer(data, dtype=np.int64)
        op, num_tokens, num_seqs, num_gathers, num_sampled, num_prompt = words[:_HEADER].tolist()
        if op == OP_SHUTDOWN:
            return op, None
        at = _HEADER

        def take(n: int) -> list[int]:
            nonlocal at
            out = words[at : at + n].tolist()
            at += n
            return out

        ids, seq_lens, query_lens = take(num_tokens), take(num_seqs), take(num_seqs)
        table_lens = take(num_seqs)
        flat = take(sum(table_lens))
        tables, start = [], 0
        for n in table_lens:
            tables.append(flat[start : start + n])
            start += n
        gathers = take(2 * num_gathers)
        sample_rows = take(num_sampled)
        prompt = take(2 * num_prompt)
        inputs = StepInputs(
            ids=ids,
            seq_lens=seq_lens,
            query_lens=query_lens,
            tables=tables,
            gathers=list(zip(gathers[0::2], gathers[1::2], strict=True)),
            sample_rows=sample_rows,
            prompt_rows=list(zip(prompt[0::2], prompt[1::2], strict=True)),
        )
        return op, inputs


def shutdown_message() -> bytes:
    return np.array([OP_SHUTDOWN] + [0] * (_HEADER - 1), dtype=np.int64).tobytes()
