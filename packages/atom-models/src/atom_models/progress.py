"""Start-up progress bars: one tqdm bar per phase (checkpoint shards, CUDA-graph sizes), as vLLM
shows them. Callers pass `enabled` (tensor-parallel rank 0 with `EngineConfig.show_progress`);
a disabled bar prints nothing and costs nothing but the iteration."""

from __future__ import annotations

from collections.abc import Iterable


def progress_bar(
    iterable: Iterable | None = None,
    *,
    desc: str,
    total: int | None = None,
    enabled: bool = True,
    unit: str = "it",
    unit_scale: bool = False,
):
    """A tqdm bar over `iterable` (or one to `update` by hand) on stderr; `enabled=False`: none.

    `disable` is never tqdm's None (off when stderr is not a terminal): a server's log file gets
    the bars too, as vLLM's does; the switch is the caller's."""
    from tqdm.auto import tqdm

    return tqdm(
        iterable, desc=desc, total=total, unit=unit, unit_scale=unit_scale, disable=not enabled
    )
