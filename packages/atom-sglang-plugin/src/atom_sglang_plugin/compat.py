"""Which SGLang version this plugin was tested with, and whether the installed one is it.

The version is also recorded in the package metadata (description, keywords); it is not an extra,
because uv locks every extra of a workspace member into the workspace's environment. SGLang's
internal interfaces (model loader, attention backends, runtime context) change between patch
releases; on another version the plugin still runs and logs that it is untested.
"""

from __future__ import annotations

import importlib.metadata

TESTED_VERSION = "0.5.23"
TESTED = f"sglang=={TESTED_VERSION}"


def installed_sglang_version() -> str | None:
    """The installed SGLang's version, read from package metadata (SGLang is not imported)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def untested_warning(version: str | None = None) -> str | None:
    """The warning to log when the installed SGLang is not the tested version, else None."""
    version = installed_sglang_version() if version is None else version
    if version is None or version.split("+")[0] == TESTED_VERSION:
        return None
    return f"SGLang {version} is untested ({TESTED} was tested); running anyway"
