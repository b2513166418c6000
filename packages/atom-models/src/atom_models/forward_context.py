"""One per-step forward context, set by the host around each forward and read by attention.

Per-step metadata (slot mapping, block tables, sequence lengths, or a host's own metadata object)
reaches the attention layers here, never through every forward signature. The context is per
thread: engines running side by side in one process (tests, a notebook) each see their own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any = None


_EMPTY = ForwardContext()
_local = threading.local()


def get_forward_context() -> ForwardContext:
    return getattr(_local, "context", _EMPTY)


@contextlib.contextmanager
def set_forward_context(attn_metadata: Any) -> Iterator[ForwardContext]:
    """Make `attn_metadata` visible to every attention layer for the duration of one forward
    (in this thread)."""
    previous = get_forward_context()
    _local.context = context = ForwardContext(attn_metadata=attn_metadata)
    try:
        yield context
    finally:
        _local.context = previous
