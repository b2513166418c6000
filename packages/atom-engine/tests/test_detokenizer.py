"""Incremental detokenization equals decoding everything at once, whatever the text."""

from __future__ import annotations

import pytest

from atom_engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is a plain sentence.",
    "Multi-byte: café naïve 東京タワー 🙂🚀 — done.",
    "   leading spaces and\n\nnewlines\tand tabs",
    "def f(x):\n    return x**2  # 😀",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(bundled_tokenizer, text):
    prompt = bundled_tokenizer.encode("Prompt:")
    ids = bundled_tokenizer.encode(text)
    detok = IncrementalDetokenizer(bundled_tokenizer, prompt)
    pieces = []
    for token in ids:
        before = detok.text
        detok.add(token)
        pieces.append(detok.text[len(before) :])
        assert "\ufffd" not in detok.text  # never a half character
    assert detok.text == bundled_tokenizer.decode(ids) == "".join(pieces)


def test_stop_strings_are_cut_and_held_back(bundled_tokenizer):
    ids = bundled_tokenizer.encode("one two three four five")
    detok = IncrementalDetokenizer(bundled_tokenizer, [], stop=["four", "ee f"])
    visible = []
    stop = None
    for token in ids:
        stop = detok.add(token)
        visible.append(detok.visible_text(finished=stop is not None))
        if stop:
            break
    # "ee f" (in "three four") matches before "four" completes; the text stops before it.
    assert stop == "ee f"
    assert detok.text == "one two thr"
    # Text shown while streaming was never taken back: each view is a prefix of the final text.
    assert all(detok.text.startswith(v) for v in visible)
