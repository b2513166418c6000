"""The server's prompt workers: every worker thread gets its own tokenizer copy at start-up, never
on a request (a copy of a large vocabulary holds the GIL long enough to stall generation)."""

from __future__ import annotations

import asyncio

from atom_engine.server.preprocess import Preprocessor


def test_worker_threads_copy_the_tokenizer_at_start_up_not_on_requests(smollm2_engine):
    engine = smollm2_engine.engine
    preprocessor = Preprocessor(engine, engine.tokenizer, num_workers=3)
    try:
        assert preprocessor.copies == 3  # before any request

        def encode_on_worker(text: str) -> tuple[int, list[int]]:
            tokenizer = preprocessor.tokenizer
            return id(tokenizer), tokenizer.encode(text)

        async def burst() -> list[tuple[int, list[int]]]:
            texts = [f"request {i}: the quick brown fox" for i in range(24)]
            return await asyncio.gather(*(preprocessor.run(encode_on_worker, t) for t in texts))

        results = asyncio.run(burst())
        assert preprocessor.copies == 3  # the burst made none
        copies = {tokenizer_id for tokenizer_id, _ in results}
        assert 1 <= len(copies) <= 3 and id(engine.tokenizer) not in copies
        for i, (_, ids) in enumerate(results):
            assert ids == engine.tokenizer.encode(f"request {i}: the quick brown fox")
    finally:
        preprocessor.shutdown()
