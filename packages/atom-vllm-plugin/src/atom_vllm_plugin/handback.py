"""Whether vLLM's own model is being built in place of ATOM's (the wrapper's fallback).

While it is, ATOM's platform gives that model's attention layers the parent platform's backend,
so a configuration ATOM does not support runs entirely on vLLM's own implementation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

_reasons: list[str] = []


@contextmanager
def building_vllms_own_model(reason: str) -> Iterator[None]:
    _reasons.append(reason)
    try:
        yield
    finally:
        _reasons.pop()


def handed_back_reason() -> str | None:
    """Why the model now being built is vLLM's own, or None when it is not."""
    return _reasons[-1] if _reasons else None
