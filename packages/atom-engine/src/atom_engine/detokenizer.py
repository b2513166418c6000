"""Incremental detokenization, correct across multi-byte characters and merged tokens.

Decoding one token at a time is wrong for byte-level BPE (a character split across tokens decodes
as U+FFFD) and for tokenizers that merge or strip spaces depending on neighbours. Instead, each
step decodes a short window of recent tokens twice (with and without the new ones) and emits the
difference, holding text back while it ends in an incomplete character. The window starts inside
the prompt so the first generated token is decoded in context.
"""

from __future__ import annotations

_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streamed text holds back this many characters: they may begin a stop string.
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # skip_tokenizer_init: token ids only, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, emit_text: bool = True, match_stop: bool = True) -> str | None:
        """Append a generated token; returns the stop string it completed, if any.

        With emit_text False (EOS, stop token ids) the token adds no text. With match_stop False
        (before min_tokens) stop strings are not looked for in the new text.
        """
        if not emit_text or self.tokenizer is None:  # no tokenizer: token ids only, no text
            return None
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # an incomplete character (or nothing visible) so far
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        start = max(0, len(self.text) - self.hold_back)
        self.text += delta
        return self._match_stop(start) if match_stop else None

    def _match_stop(self, search_from: int) -> str | None:
        matches = [(self.text.find(s, search_from), s) for s in self.stop]
        matches = [(at, s) for at, s in matches if at != -1]
        if not matches:
            return None
        at, stop = min(matches)  # the earliest stop string in the text wins
        self.text = self.text[: at + len(stop) if self.include_stop_str_in_output else at]
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: all of it once finished, else without the held tail."""
        if finished or not self.stop or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]
