"""Backend selection, explicit-backend errors, automatic fallback, per-op fallback to torch."""

import importlib.machinery
import importlib.util
import logging
import sys
import types

import pytest
import torch

import atom_kernels as ak
from atom_kernels import registry
from atom_kernels.backends.cpu import attention as cpu_attention
from atom_kernels.backends.torch import norm as torch_norm


@pytest.fixture(autouse=True)
def clean_registry(monkeypatch):
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    # Each test gets its own registrations and import results; the originals come back after.
    # (The torch and cpu backends are already imported above, so their ops are in the originals.)
    monkeypatch.setattr(registry, "_IMPLS", {k: dict(v) for k, v in registry._IMPLS.items()})
    monkeypatch.setattr(registry, "_IMPORTED", dict(registry._IMPORTED))
    registry._reset_for_tests()
    yield
    registry._reset_for_tests()


@pytest.mark.parametrize("env", [None, "auto", "AUTO", ""])
def test_auto_on_cpu_is_cpu_with_torch_for_the_rest(monkeypatch, env):
    if env is not None:
        monkeypatch.setenv(registry.ENV_VAR, env)
    assert ak.current_backend(torch.device("cpu")) == "cpu"
    assert ak.get_op("paged_attention", "cpu") is cpu_attention.paged_attention
    # The cpu backend implements only its hot ops: the rest is the torch reference.
    assert ak.get_op("rms_norm", "cpu") is torch_norm.rms_norm


def test_explicit_cpu_on_a_gpu_device_raises(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "cpu")
    with pytest.raises(RuntimeError, match=r"the cpu backend runs on CPU tensors only"):
        ak.current_backend("cuda")


def test_explicit_torch(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    assert ak.current_backend("cpu") == "torch"
    x = torch.randn(3, 8)
    assert ak.silu_and_mul(x).shape == (3, 4)


def test_unknown_backend_raises_naming_it(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "cutlass")
    with pytest.raises(ValueError, match=r"ATOM_KERNEL_BACKEND='cutlass' is not a kernel backend"):
        ak.rms_norm(torch.randn(2, 4), torch.rand(4), 1e-6)


def test_explicit_triton_on_cpu_without_interpreter_raises(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    why = "TRITON_INTERPRET=1" if importlib.util.find_spec("triton") else "not installed"
    with pytest.raises(
        RuntimeError, match=rf"backend 'triton' cannot run on device type 'cpu'.*{why}"
    ):
        ak.current_backend("cpu")


def test_explicit_backend_without_its_package_raises(monkeypatch):
    # sys.modules[name] = None makes `import name` raise ImportError: a backend package that
    # is missing (or broken) in this install.
    monkeypatch.setitem(sys.modules, "atom_kernels.backends.triton", None)
    monkeypatch.setitem(registry._IMPLS, "triton", {})
    monkeypatch.setattr(registry, "_hardware_problem", lambda backend, device_type: None)
    monkeypatch.setenv(registry.ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match=r"importing atom_kernels\.backends\.triton failed"):
        ak.get_op("rms_norm", "cpu")


def test_explicit_aiter_says_there_is_none(monkeypatch):
    monkeypatch.setenv(registry.ENV_VAR, "aiter")
    with pytest.raises(
        RuntimeError, match=r"backend 'aiter' cannot run.*ATOM has no AITER backend"
    ):
        ak.current_backend("cuda")


def _rocm_with_aiter_installed(monkeypatch) -> None:
    """This process as on a ROCm machine where the `aiter` package is importable."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (
            importlib.machinery.ModuleSpec(name, None) if name == "aiter" else find_spec(name, *a)
        ),
    )


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton installed")
def test_automatic_choice_on_rocm_is_triton_without_an_aiter_backend(monkeypatch):
    _rocm_with_aiter_installed(monkeypatch)
    assert registry._auto_backends("cuda") == ["triton", "torch"]


def test_automatic_choice_that_cannot_load_falls_back_to_the_next(monkeypatch, caplog):
    # An AITER backend package present but unloadable: the next choice is Triton, not the
    # torch reference (AMD users would otherwise get the slowest path without a word).
    monkeypatch.setattr(
        registry, "_auto_backends", lambda device_type: ["aiter", "triton", "torch"]
    )
    monkeypatch.setattr(
        registry,
        "_hardware_problem",
        lambda backend, device_type: "broken" if backend == "aiter" else None,
    )
    _fake_triton_backend(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="atom_kernels"):
        assert ak.current_backend("cuda") == "triton"
    (warning,) = caplog.records
    assert "'aiter'" in warning.getMessage() and "backend 'triton'" in warning.getMessage()


def test_automatic_choice_that_cannot_load_falls_back_to_torch_and_logs_once(monkeypatch, caplog):
    monkeypatch.setattr(registry, "_auto_backends", lambda device_type: ["aiter", "torch"])
    with caplog.at_level(logging.DEBUG, logger="atom_kernels"):
        assert ak.current_backend("cuda") == "torch"
        assert ak.current_backend("cuda:0") == "torch"
        assert ak.get_op("rms_norm", "cuda") is torch_norm.rms_norm
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "'aiter'" in warnings[0].getMessage() and "torch" in warnings[0].getMessage()


def _fake_triton_backend(monkeypatch):
    """A stand-in triton backend that implements only silu_and_mul, usable on CPU."""
    module = types.ModuleType("atom_kernels.backends.triton")
    monkeypatch.setitem(sys.modules, "atom_kernels.backends.triton", module)
    # Only the fake's op: the real backend may have registered its ops earlier in this process.
    monkeypatch.setitem(registry._IMPLS, "triton", {})
    monkeypatch.setattr(registry, "_hardware_problem", lambda backend, device_type: None)
    calls = []

    @registry.register_op("silu_and_mul", "triton")
    def fake_silu_and_mul(x):
        calls.append(x.shape)
        return torch.full((*x.shape[:-1], x.shape[-1] // 2), 7.0, dtype=x.dtype)

    return calls


@pytest.mark.parametrize("explicit", [True, False])
def test_op_missing_from_backend_falls_back_to_torch(monkeypatch, caplog, explicit):
    calls = _fake_triton_backend(monkeypatch)
    if explicit:
        monkeypatch.setenv(registry.ENV_VAR, "triton")
    else:
        monkeypatch.setattr(registry, "_auto_backends", lambda device_type: ["triton", "torch"])
    x = torch.randn(3, 8)
    with caplog.at_level(logging.DEBUG, logger="atom_kernels"):
        assert ak.current_backend("cpu") == "triton"
        assert bool((ak.silu_and_mul(x) == 7.0).all()) and calls == [x.shape]
        weight = torch.rand(8)
        for _ in range(3):
            out = ak.rms_norm(x, weight, 1e-6)
        assert torch.equal(out, torch_norm.rms_norm(x, weight, 1e-6))
    fallbacks = [r for r in caplog.records if "has no 'rms_norm'" in r.getMessage()]
    assert len(fallbacks) == 1
    assert fallbacks[0].levelno == (logging.INFO if explicit else logging.DEBUG)


def test_choice_is_cached_until_reset(monkeypatch):
    assert ak.current_backend("cpu") == "cpu"
    monkeypatch.setenv(registry.ENV_VAR, "cutlass")
    assert ak.current_backend("cpu") == "cpu"  # chosen once per process
    registry._reset_for_tests()
    with pytest.raises(ValueError, match="cutlass"):
        ak.current_backend("cpu")


def test_register_op_rejects_unknown_backend():
    with pytest.raises(ValueError, match="register_op: unknown backend 'cuda'"):
        registry.register_op("rms_norm", "cuda")


def test_unknown_op():
    with pytest.raises(KeyError, match="no op named 'no_such_op'"):
        ak.get_op("no_such_op", "cpu")


def test_resolve_ops_fills_the_cache_for_every_op():
    registry.resolve_ops("cpu")
    assert set(registry.registered_ops("torch")) <= {op for op, dev in registry._RESOLVED}
    assert registry._RESOLVED[("paged_attention", "cpu")] is cpu_attention.paged_attention
    assert registry._RESOLVED[("rms_norm", "cpu")] is torch_norm.rms_norm


def test_has_own_op_tells_the_backend_s_ops_from_its_fallbacks(monkeypatch):
    # The cpu backend writes the KV cache itself; the fused rotary + cache write is the torch
    # reference's there, so ATOM's attention keeps the two ops apart on the CPU.
    assert registry.has_own_op("reshape_and_cache", "cpu")
    assert not registry.has_own_op("rotary_embedding_and_cache", "cpu")
    registry._reset_for_tests()
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    assert registry.has_own_op("rotary_embedding_and_cache", "cpu")
