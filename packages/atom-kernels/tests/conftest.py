"""The ``triton_backend`` fixture: the Triton backend, compiled on a GPU, interpreted on the CPU.

Whether a ``@triton.jit`` function is compiled or interpreted is fixed when it is decorated, and
Triton's own library (``tl.sum``, ``tl.cdiv``, ...) is decorated when ``triton`` is first imported.
So the interpreter needs ``TRITON_INTERPRET=1`` in the environment before anything in the process
imports triton, which a shared pytest process cannot promise (torch.compile, transformers, ... may
import it first) and which must not leak into the other packages' tests. Hence:

- On a GPU the fixture hands out the compiled backend and ``cuda``.
- Without a GPU, ``test_triton_interpreter.py`` runs the ``test_triton_*`` files in a child pytest
  process started with ``TRITON_INTERPRET=1``; in that child the fixture hands out the interpreted
  backend and ``cpu``. In the parent process the fixture skips (the child runs those tests).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

BACKEND = "atom_kernels.backends.triton"


def interpreter_child() -> bool:
    """True in a process started with TRITON_INTERPRET=1 (the interpreter child)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _fix_interpreter_casts(mp: pytest.MonkeyPatch) -> None:
    """Make Triton's CPU interpreter convert floats exactly as the GPU does.

    NOTE (triton 3.9 interpreter): ``_convert_float`` rounds a downcast half-up and does not carry
    a rounded-up mantissa into the exponent (31.5 -> fp8 e4m3 gives 16, not 32; the same for
    bf16), and ``create_dot`` multiplies bf16 operands as their raw uint16 bits. GPU code is not
    affected. The fix routes conversions between torch-known float formats through torch
    (round-to-nearest-even, as the GPU) and dots with bf16 operands through fp32 (exact products,
    fp32 accumulation, as the tensor cores).
    """
    import triton.language as tl
    from triton.runtime import interpreter

    torch_dtypes = {
        tl.float64: torch.float64,
        tl.float32: torch.float32,
        tl.float16: torch.float16,
        tl.bfloat16: torch.bfloat16,
        tl.float8e4nv: torch.float8_e4m3fn,
        tl.float8e5: torch.float8_e5m2,
        tl.float8e4b8: torch.float8_e4m3fnuz,
        tl.float8e5b16: torch.float8_e5m2fnuz,
    }
    signed = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
    original = interpreter._convert_float
    rtz = interpreter._ir.ROUNDING_MODE.RTZ

    def convert_float(data, input_dtype, output_dtype, rounding_mode):
        src, dst = torch_dtypes.get(input_dtype), torch_dtypes.get(output_dtype)
        if src is None or dst is None or rounding_mode == rtz:
            return original(data, input_dtype, output_dtype, rounding_mode)
        bits = np.array(data, copy=True).view(signed[src.itemsize])
        converted = torch.from_numpy(bits).view(src).to(dst)
        return (
            converted.view(getattr(torch, f"int{8 * dst.itemsize}"))
            .numpy()
            .view(unsigned[dst.itemsize])
        )

    def as_fp32(handle):
        if handle.dtype != tl.bfloat16:
            return handle
        data = convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    create_dot = interpreter.InterpreterBuilder.create_dot

    def exact_create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, as_fp32(a), as_fp32(b), d, input_precision, max_num_imprecise_acc)

    mp.setattr(interpreter, "_convert_float", convert_float)
    mp.setattr(interpreter.InterpreterBuilder, "create_dot", exact_create_dot)


@pytest.fixture(scope="session")
def triton_backend():
    """Namespace: ``device`` ("cuda" or "cpu"), ``interpreted``, and the backend's modules
    (``norm``, ``rotary``, ``activation``, ``cache``, ``attention``, ``mla_cache``,
    ``mla_attention``, ``custom_ops``)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    interpreted = interpreter_child()
    if not interpreted and not torch.cuda.is_available():
        pytest.skip("no GPU: test_triton_interpreter.py runs this under TRITON_INTERPRET=1")
    backend = importlib.import_module(BACKEND)
    mp = pytest.MonkeyPatch()
    if interpreted:
        _fix_interpreter_casts(mp)
    import triton.language as tl

    from atom_kernels.backends.triton import (
        activation,
        attention,
        cache,
        custom_ops,
        mla_attention,
        mla_cache,
        norm,
        rotary,
        sampling,
    )

    kernel_type = type(norm._rms_norm_kernel).__name__
    library_type = type(tl.standard.sum).__name__
    if {kernel_type == "InterpretedFunction", library_type == "InterpretedFunction"} != {
        interpreted
    }:
        pytest.fail(
            f"the Triton kernels are {kernel_type}s and triton's library {library_type}s, expected "
            f"{'interpreted' if interpreted else 'compiled'} ones: TRITON_INTERPRET changed after "
            "triton was imported"
        )
    yield SimpleNamespace(
        device=torch.device("cpu" if interpreted else "cuda"),
        interpreted=interpreted,
        backend=backend,
        activation=activation,
        attention=attention,
        cache=cache,
        custom_ops=custom_ops,
        mla_attention=mla_attention,
        mla_cache=mla_cache,
        norm=norm,
        rotary=rotary,
        sampling=sampling,
    )
    mp.undo()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without a GPU and outside the interpreter child, the tests that take ``triton_backend``
    run in the child (test_triton_interpreter.py): deselect them here instead of skipping each.
    In the child, a test marked ``interpreter_slow`` (statistical draws of many rows: minutes of
    the interpreter's time, seconds compiled) is ``slow`` too, so the default child skips it and
    the slow step's child (``--run-slow``) runs it; on a GPU it runs by default."""
    if interpreter_child():
        for item in items:
            if item.get_closest_marker("interpreter_slow"):
                item.add_marker(pytest.mark.slow)
        return
    if torch.cuda.is_available():
        return
    deselected = [item for item in items if "triton_backend" in getattr(item, "fixturenames", ())]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]
