"""The plugin's logger: a child of SGLang's `sglang` logger, so its lines print in SGLang's format.

Every line starts with "ATOM:" so a user can grep SGLang's startup log for what the plugin did.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sglang.atom")
_logged: set[str] = set()


def _log_once(level: int, msg: str, args: tuple[object, ...]) -> None:
    line = msg % args if args else msg
    if line in _logged:
        return
    _logged.add(line)
    logger.log(level, "ATOM: %s", line, stacklevel=3)


def info_once(msg: str, *args: object) -> None:
    """Log at INFO once per process (the hook and the model lookup run many times)."""
    _log_once(logging.INFO, msg, args)


def warning_once(msg: str, *args: object) -> None:
    _log_once(logging.WARNING, msg, args)
