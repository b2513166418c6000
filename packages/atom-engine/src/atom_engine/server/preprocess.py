"""Requests' prompts -> checked token ids, on worker threads: never on the event loop (health
checks and rejections stay instant) nor on the engine thread (generation never waits for a
tokenizer).

Each worker thread has its own copy of the tokenizer (a fast tokenizer's Rust core is borrowed
mutably while it encodes, so one object must not encode on two threads at once), made when the
server starts: copied on a thread's first request instead, Qwen3's tokenizer (151K entries) took
~130 ms a copy with the GIL held, and the first burst of 16 concurrent requests stalled the
engine thread 450-580 ms (one H100, `atom bench serve` at concurrency 16; benchmarks/HISTORY.md,
"Whole-forward graphs"). A prompt is
rejected before it is tokenized when its text is longer than any prompt that fits the context.
"""

from __future__ import annotations

import asyncio
import copy
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

from atom_engine.chat_template import apply_chat_template
from atom_engine.engine import LLMEngine
from atom_engine.sampling_params import InvalidRequest, SamplingParams

T = TypeVar("T")

# NOTE: Unicode normalizers may shrink text (composition), so the bound on characters per token
# (the longest vocabulary entry) gets this margin before a prompt is refused untokenized.
_CHARS_MARGIN = 4


class Preprocessor:
    def __init__(self, engine: LLMEngine, tokenizer, num_workers: int | None = None) -> None:
        self.engine = engine
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._copy_lock = threading.Lock()
        workers = num_workers or min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="atom-tokenize")
        self.copies = 0  # tokenizer copies made (one per worker thread)
        if tokenizer is not None:
            self._copy_tokenizers(workers)

    def _copy_tokenizers(self, workers: int) -> None:
        """Start every worker thread now, each with its tokenizer copy: `workers` tasks that wait
        for each other keep any thread from taking two, so the pool starts all of its threads."""
        barrier = threading.Barrier(workers)

        def copy_one() -> None:
            _ = self.tokenizer
            barrier.wait(timeout=120)

        for future in [self._pool.submit(copy_one) for _ in range(workers)]:
            future.result()
        self.max_prompt_chars = self._max_prompt_chars()

    def _max_prompt_chars(self) -> int | None:
        vocab = self._tokenizer.get_vocab() if self._tokenizer is not None else None
        if not vocab:
            return None
        longest = max(len(token) for token in vocab)
        return _CHARS_MARGIN * longest * self.engine.max_model_len

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @property
    def tokenizer(self):
        """This worker thread's own tokenizer."""
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._copy_lock:
                tokenizer = self._local.tokenizer = copy.deepcopy(self._tokenizer)
                self.copies += 1
        return tokenizer

    # -- on a worker thread --------------------------------------------------------------------

    def _check_text(self, text: str) -> None:
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"the prompt has {len(text)} characters: more tokens than the model's context "
                f"length (max_model_len) {self.engine.max_model_len}"
            )

    def _check(self, token_ids: list[int], params: SamplingParams) -> SamplingParams:
        params = replace(params)  # the engine fills in per-request fields
        self.engine.check_request(token_ids, params)
        return params

    def completion_prompts(
        self, prompts: list[str | list[int]], params: SamplingParams
    ) -> list[tuple[dict, SamplingParams]]:
        """(engine prompt, its params) of every prompt; ValueError for the first bad one."""
        if self.engine.tokenizer is None and any(isinstance(p, str) for p in prompts):
            raise ValueError("text prompts need a tokenizer (the server runs without one)")
        for prompt in prompts:
            if isinstance(prompt, str):
                self._check_text(prompt)
        result = []
        for prompt in prompts:
            if isinstance(prompt, str):
                token_ids = self.tokenizer.encode(prompt, add_special_tokens=True)
                engine_prompt = {"prompt": prompt, "prompt_token_ids": token_ids}
            else:
                token_ids = prompt
                engine_prompt = {"prompt_token_ids": token_ids}
            result.append((engine_prompt, self._check(token_ids, params)))
        return result

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        params: SamplingParams,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template: str | None,
        chat_template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> tuple[dict, SamplingParams]:
        """The engine prompt of a conversation rendered by the chat template (given `tools`),
        and its params (with the compiled grammar of their structured output, if any)."""
        if self._tokenizer is None:
            raise ValueError("chat needs a tokenizer (the server runs without one)")
        self._check_text("".join(m.get("content") or "" for m in messages))
        token_ids = apply_chat_template(
            self.tokenizer,
            messages,
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            chat_template,
            self.max_prompt_chars,
            tools,
        )
        return {"prompt_token_ids": token_ids}, self._check(token_ids, params)
