"""Structured output: xgrammar grammars that constrain what a request may generate.

A request's `StructuredOutputsParams` (JSON schema, regex, choice, EBNF grammar, any JSON object)
is compiled for the model's tokenizer by `GrammarCompiler`, once per spec (cached; the server
compiles on its worker threads, never on the event loop or the engine thread). Each sequence of a
constrained request holds a `GrammarState` (its own matcher: n > 1 samples diverge). The engine
touches them in two places:

- `apply_grammar_bitmasks(seqs, logits)` before sampling: the rows of constrained sequences get
  -inf on every token their grammar forbids next; other rows are left alone.
- `GrammarState.advance(token_ids)` when postprocess appends tokens: True once the grammar is
  terminated (it accepted a stop token after a complete match), which finishes the sequence.

Constrained requests are sampled on the host every step (the mask of step N+1 needs step N's
token in the matcher), like requests with log-probs.

Speculative decoding verifies k+1 positions of a sequence in one step: `apply_grammar_bitmasks`
masks all k+1 rows (`fill_bitmasks(draft, bitmask, row)`: the matcher takes the draft tokens one
by one and rolls them back, so its state is unchanged); a draft token the grammar forbids has
probability 0 under the masked target and is rejected. Postprocess then advances the matcher by
each emitted token (the accepted drafts and the bonus / resampled one).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from typing import TYPE_CHECKING

import torch

from atom_engine.sampling_params import InvalidRequest, StructuredOutputsParams

if TYPE_CHECKING:
    from atom_engine.sequence import Sequence

logger = logging.getLogger("atom_engine")

# Compiled grammars kept (per engine); a spec compiled again after eviction is a cache miss only.
CACHE_SIZE = 256
# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:line: ": not for the client.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def spec_key(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text) of a spec: what is compiled, and the cache key. A dict schema is its JSON
    text with the keys in the given order (properties are generated in that order)."""
    kind = spec.kind
    value = getattr(spec, kind)
    if kind == "json" and isinstance(value, dict):
        return kind, json.dumps(value)
    if kind == "choice":
        return kind, json.dumps(value)
    return kind, "" if kind == "json_object" else value


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices` (string literals JSON-escaped, which
    xgrammar's EBNF reads)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs for one tokenizer (thread-safe). xgrammar and its tokenizer tables load on
    the first compile, so an engine that never sees a constrained request never pays for them."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: set[int]) -> None:
        self._tokenizer = tokenizer  # a private copy: built on a worker thread
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: dict[tuple[str, str], object] = {}
        self.num_compiled = 0  # cache misses (tests and logs read it)

    def _xgrammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                if self._tokenizer is None:
                    raise InvalidRequest(
                        "structured outputs need a tokenizer (the engine runs without one)",
                        "structured_outputs",
                    )
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
                self._compiler = xgr.GrammarCompiler(info)
            return self._compiler

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (cached); InvalidRequest naming `structured_outputs`
        when it does not compile (a bad schema, regex or grammar)."""
        key = spec_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
        if compiled is not None:
            return compiled
        compiler = self._xgrammar_compiler()
        kind, text = key
        try:
            if kind == "json":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "json_object":
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "choice":
                compiled = compiler.compile_grammar(choice_grammar(spec.choice))
            else:
                compiled = compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            reason = _XGRAMMAR_PREFIX.sub("", str(e).strip())
            raise InvalidRequest(
                f"structured output {kind} does not compile: {reason}", "structured_outputs"
            ) from None
        with self._lock:
            self.num_compiled += 1
            if len(self._cache) >= CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))  # the oldest
            self._cache[key] = compiled
        return compiled


class GrammarState:
    """One sequence's position in its grammar (an xgrammar matcher). Stop tokens are the
    engine's EOS ids and the request's stop_token_ids: allowed only where the grammar is
    complete, and accepting one terminates it."""

    def __init__(self, compiled, stop_token_ids: set[int]) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stop_token_ids))

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def advance(self, token_ids: list[int]) -> bool:
        """Accept generated tokens in order; True when the grammar is now terminated. A token
        the grammar forbids (it was masked: only a filter that removes every allowed token, such
        as allowed_token_ids, gets one sampled) is a ValueError: the request fails alone."""
        for token_id in token_ids:
            if not self.matcher.accept_token(token_id):
                raise ValueError(
                    f"the sampled token {token_id} does not match the request's structured "
                    "output (another filter, e.g. allowed_token_ids, removed every token the "
                    "grammar allows)"
                )
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] = the tokens allowed next (bitmask: int32 [R, ceil(V / 32)], CPU)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def fill_bitmasks(self, draft: list[int], bitmask: torch.Tensor, row: int) -> int:
        """Speculative decoding: bitmask[row + j] = the tokens allowed at position j of a
        verification of `draft` (j = 0..len(draft)), i.e. after draft[:j]. The matcher takes
        the draft tokens to get there and gives them back: its state is unchanged. Positions
        after a draft token the grammar rejects (or after it terminates) keep their rows as
        they are (verification stops there). Returns how many draft tokens the grammar accepts.
        """
        accepted = 0
        for j in range(len(draft) + 1):
            if self.matcher.is_terminated():
                break
            self.matcher.fill_next_token_bitmask(bitmask, row + j)
            if j == len(draft) or not self.matcher.accept_token(draft[j]):
                break
            accepted += 1
        if accepted:
            self.matcher.rollback(accepted)
        return accepted


def apply_grammar_bitmasks(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
    """Mask, in place, the logits rows [R, V] of the constrained sequences among `seqs` to what
    their grammars allow; returns `logits`. Each sequence has 1 + len(spec_token_ids) rows, in
    order: one without drafts, the k+1 verified positions with k drafts (speculative decoding).
    """
    counts = [1 + len(seq.spec_token_ids) for seq in seqs]
    if all(seq.grammar is None for seq in seqs):
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(sum(counts), logits.shape[-1])
    rows, at = [], 0
    for seq, count in zip(seqs, counts, strict=True):
        if seq.grammar is not None:
            if count == 1:
                seq.grammar.fill_bitmask(bitmask, at)
            else:
                seq.grammar.fill_bitmasks(seq.spec_token_ids, bitmask, at)
            rows += range(at, at + count)
        at += count
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits
