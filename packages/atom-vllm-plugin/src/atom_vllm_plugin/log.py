"""The plugin's logger: a child of vLLM's `vllm` logger, so its lines print in vLLM's format.

Every line starts with "ATOM:" so a user can grep vLLM's startup log for what the plugin did.
vLLM resolves its platform and loads plugins before it configures logging (vLLM 0.32 configures
it when an engine or server starts); lines logged before that are held and printed once vLLM's
handler exists (`flush_pending`, called from the ATOM platform's `log_warnings`, which vLLM calls
right after configuring logging, or by the next line logged).
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("vllm.atom")
_logged: set[str] = set()
_pending: list[tuple[int, str]] = []


def _logging_configured() -> bool:
    # VLLM_CONFIGURE_LOGGING=0: the application configures logging itself; never hold lines.
    return (
        bool(logging.getLogger("vllm").handlers)
        or os.environ.get("VLLM_CONFIGURE_LOGGING", "1").strip() == "0"
    )


def flush_pending() -> None:
    """Print the lines held while vLLM's logging was not configured yet."""
    if not _logging_configured():
        return
    while _pending:
        level, line = _pending.pop(0)
        logger.log(level, "ATOM: %s", line)


def _log_once(level: int, msg: str, args: tuple[object, ...]) -> None:
    line = msg % args if args else msg
    if line in _logged:
        return
    _logged.add(line)
    if not _logging_configured():
        _pending.append((level, line))
        return
    flush_pending()
    logger.log(level, "ATOM: %s", line, stacklevel=3)


def info_once(msg: str, *args: object) -> None:
    """Log at INFO once per process (hooks and platform methods run many times)."""
    _log_once(logging.INFO, msg, args)


def warning_once(msg: str, *args: object) -> None:
    _log_once(logging.WARNING, msg, args)
