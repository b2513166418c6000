"""Which SGLang version this plugin was tested with, and whether the installed one is it.

The version is also recorded in the package metadata (description, keywords); it is not an extra,
because uv locks every extra of a workspace member into the workspace's environment. SGLang's
internal interfaces (model loader, attention backends, runtime context) change between patch
releases, so on another version the plugin steps aside (with a WARNING; `--model-impl atom` is then
SGLang's own lookup) unless `ATOM_SGLANG_PLUGIN_ALLOW_UNTESTED=1`.
"""

from __future__ import annotations

import importlib.metadata

from atom_sglang_plugin.switches import ALLOW_UNTESTED, untested_allowed

TESTED_VERSION = "0.5.23"
TESTED = f"sglang=={TESTED_VERSION}"


def installed_sglang_version() -> str | None:
    """The installed SGLang's version, read from package metadata (SGLang is not imported)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def is_tested(version: str) -> bool:
    return version.split("+")[0] == TESTED_VERSION


def version_problem(version: str | None = None) -> str | None:
    """Why the plugin steps aside for this SGLang version, or None when it may run."""
    version = installed_sglang_version() if version is None else version
    if version is None or is_tested(version) or untested_allowed():
        return None
    return (
        f"SGLang {version} is not the version this plugin was tested with ({TESTED}); "
        f"set {ALLOW_UNTESTED}=1 to run it anyway"
    )


def untested_warning(version: str | None = None) -> str | None:
    """The warning to log when running on an untested version because the user allowed it."""
    version = installed_sglang_version() if version is None else version
    if version is None or is_tested(version) or not untested_allowed():
        return None
    return (
        f"SGLang {version} is untested ({TESTED} was tested); running anyway because "
        f"{ALLOW_UNTESTED}=1"
    )
