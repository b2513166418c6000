"""One per-step forward context, set by the host around each forward and read by attention.

Per-step metadata (slot mapping, block tables, sequence lengths, or a host's own metadata object)
reaches the attention layers here, never through every forward signature.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any = None


_context = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _context


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention layer for the duration of one forward."""
    global _context
    previous, _context = _context, ForwardContext(attn_metadata=attn_metadata)
    try:
        yield _context
    finally:
        _context = previous
