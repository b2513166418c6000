"""Backend registry: which implementation of an op runs on which device.

A backend is a package ``atom_kernels.backends.<name>`` whose modules decorate their functions with
``@register_op(op_name, "<name>")``; importing the package registers its ops. The registry imports a
backend lazily, the first time a device type needs it, so adding a backend is adding that package.

The backend is chosen once per process per device type ("cpu", "cuda", ...):

- ``ATOM_KERNEL_BACKEND=torch|cpu|triton|aiter`` asks for one explicitly. If it cannot load (package
  missing, wrong hardware, unknown name) the first op call raises, naming the backend and why.
- Unset or ``auto``: CPU -> cpu (fast CPU versions of the hot ops, the torch reference for the
  rest); a CUDA or ROCm device -> triton when ``triton`` is importable, else torch. An automatic
  choice that cannot load falls back to the next (triton, then the torch reference) and logs once.

ATOM ships no AITER backend yet: "aiter" is the name reserved for one (a package
``atom_kernels.backends.aiter``, used automatically on ROCm once it exists and ``aiter`` is
importable); asking for it explicitly fails, saying so.

An op the chosen backend does not implement runs the torch reference, logged once per op (debug
level for an automatic choice, info for an explicit one).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import torch

from atom_kernels import envs

logger = logging.getLogger("atom_kernels")

BACKENDS = ("torch", "cpu", "triton", "aiter")
ENV_VAR = "ATOM_KERNEL_BACKEND"

F = TypeVar("F", bound=Callable)

# backend -> op name -> implementation; filled by @register_op as backend modules are imported.
_IMPLS: dict[str, dict[str, Callable]] = {name: {} for name in BACKENDS}
# device type -> (backend name, was it requested explicitly)
_SELECTED: dict[str, tuple[str, bool]] = {}
# (op name, device type) -> implementation
_RESOLVED: dict[tuple[str, str], Callable] = {}
# backend name -> None when imported, else the import error message
_IMPORTED: dict[str, str | None] = {}


def register_op(op_name: str, backend: str) -> Callable[[F], F]:
    """Decorator: register ``fn`` as ``backend``'s implementation of ``op_name``."""
    if backend not in BACKENDS:
        raise ValueError(f"register_op: unknown backend {backend!r}, expected one of {BACKENDS}")

    def decorator(fn: F) -> F:
        _IMPLS[backend][op_name] = fn
        return fn

    return decorator


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def _hardware_problem(backend: str, device_type: str) -> str | None:
    """Why ``backend`` cannot run on ``device_type`` here (None if it can), before importing it."""
    if backend == "torch":
        return None
    if backend == "cpu":
        if device_type != "cpu":
            return f"the cpu backend runs on CPU tensors only (device type {device_type!r})"
        return None
    if backend == "triton":
        if importlib.util.find_spec("triton") is None:
            return "the 'triton' package is not installed"
        if device_type == "cpu":
            if os.environ.get("TRITON_INTERPRET") != "1":
                return "Triton needs a CUDA/ROCm GPU; on CPU set TRITON_INTERPRET=1 to interpret it"
            return None
        if device_type != "cuda":
            return f"Triton does not support device type {device_type!r}"
        return None
    if backend == "aiter":
        if not _has_backend_package("aiter"):
            return "ATOM has no AITER backend yet (no package atom_kernels.backends.aiter)"
        if device_type != "cuda" or torch.version.hip is None:
            return f"AITER needs a ROCm GPU (device type {device_type!r}, HIP {torch.version.hip})"
        if importlib.util.find_spec("aiter") is None:
            return "the 'aiter' package is not installed"
        return None
    return f"unknown backend, expected one of {BACKENDS}"


def _import_backend(backend: str) -> str | None:
    """Import ``atom_kernels.backends.<backend>`` once; return None or the reason it failed."""
    if backend not in _IMPORTED:
        module = f"atom_kernels.backends.{backend}"
        try:
            importlib.import_module(module)
            _IMPORTED[backend] = None
        except ImportError as e:
            _IMPORTED[backend] = f"importing {module} failed: {e}"
    return _IMPORTED[backend]


def _load_problem(backend: str, device_type: str) -> str | None:
    return _hardware_problem(backend, device_type) or _import_backend(backend)


def _has_backend_package(backend: str) -> bool:
    return importlib.util.find_spec(f"atom_kernels.backends.{backend}") is not None


def _auto_backends(device_type: str) -> list[str]:
    """The automatic choices for `device_type`, best first (the torch reference last)."""
    if device_type == "cpu":
        return ["cpu", "torch"]
    if device_type != "cuda":
        return ["torch"]
    out = []
    if (
        torch.version.hip is not None
        and _has_backend_package("aiter")
        and importlib.util.find_spec("aiter") is not None
    ):
        out.append("aiter")
    if importlib.util.find_spec("triton") is not None:
        out.append("triton")
    return [*out, "torch"]


def _select(device_type: str) -> tuple[str, bool]:
    if device_type in _SELECTED:
        return _SELECTED[device_type]
    requested = envs.ATOM_KERNEL_BACKEND  # stripped, lower case
    if requested in ("", "auto"):
        candidates = _auto_backends(device_type)
        for backend, fallback in zip(candidates, [*candidates[1:], None], strict=True):
            problem = None if backend == "torch" else _load_problem(backend, device_type)
            if problem is None:
                break
            logger.warning(
                "atom_kernels: backend %r was chosen automatically for %s but cannot load (%s); "
                "using %s",
                backend,
                device_type,
                problem,
                "the torch reference backend" if fallback == "torch" else f"backend {fallback!r}",
            )
        choice = (backend, False)
    else:
        if requested not in BACKENDS:
            raise ValueError(
                f"{ENV_VAR}={requested!r} is not a kernel backend; expected one of "
                f"{', '.join(BACKENDS)} or 'auto'"
            )
        problem = _load_problem(requested, device_type)
        if problem is not None:
            raise RuntimeError(
                f"{ENV_VAR}={requested!r} was requested but backend {requested!r} cannot run on "
                f"device type {device_type!r}: {problem}"
            )
        choice = (requested, True)
    if choice[0] == "torch":
        _import_backend("torch")
    logger.debug("atom_kernels: using backend %r for device type %r", choice[0], device_type)
    _SELECTED[device_type] = choice
    return choice


def current_backend(device: torch.device | str) -> str:
    """The backend name ("torch" | "cpu" | "triton" | "aiter") ops on ``device`` dispatch to."""
    return _select(_device_type(device))[0]


def get_op(op_name: str, device: torch.device | str) -> Callable:
    """The implementation of ``op_name`` for tensors on ``device`` (torch fallback if missing)."""
    device_type = _device_type(device)
    fn = _RESOLVED.get((op_name, device_type))
    if fn is not None:
        return fn
    backend, explicit = _select(device_type)
    fn = _IMPLS[backend].get(op_name)
    if fn is None:
        problem = _import_backend("torch")
        if problem is not None:  # pragma: no cover - the torch backend ships with the package
            raise RuntimeError(problem)
        fn = _IMPLS["torch"].get(op_name)
        if fn is None:
            raise KeyError(f"atom_kernels: no op named {op_name!r} is registered")
        logger.log(
            logging.INFO if explicit else logging.DEBUG,
            "atom_kernels: backend %r has no %r; using the torch reference for it",
            backend,
            op_name,
        )
    _RESOLVED[(op_name, device_type)] = fn
    return fn


def resolve_ops(device: torch.device | str) -> None:
    """Choose the backend for ``device`` and resolve every op now (backend imports, fallbacks and
    their log lines), so code traced later (torch.compile) only reads the caches."""
    device_type = _device_type(device)
    _select(device_type)
    _import_backend("torch")
    for op_name in list(_IMPLS["torch"]):
        get_op(op_name, device_type)


def has_own_op(op_name: str, device: torch.device | str) -> bool:
    """Whether the backend chosen for ``device`` implements ``op_name`` itself (not through the
    torch reference fallback)."""
    return op_name in _IMPLS[_select(_device_type(device))[0]]


def registered_ops(backend: str) -> list[str]:
    """Names of the ops ``backend`` implements (after it has been imported)."""
    return sorted(_IMPLS[backend])


def _reset_for_tests() -> None:
    """Forget the per-device choices and resolved ops (registrations and imports are kept)."""
    _SELECTED.clear()
    _RESOLVED.clear()
    for backend, problem in list(_IMPORTED.items()):
        if problem is not None:  # let a test retry an import that failed
            del _IMPORTED[backend]
