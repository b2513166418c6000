"""The page-cache reader (`ATOM_SAFETENSORS_DIRECT=register`, `safetensors_registered`): its
chunk plan, and every architecture's tiny multi-shard checkpoint read bit-equal to the serial
reader, on the CPU (no registration, CPU copies: the same walk) and on a GPU (registered pages,
DMA), with chunks smaller than a tensor and the fewest chunks registered at once."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

import pytest
import torch

import atom_models.safetensors_registered as registered
from atom_models.safetensors_direct import read_header
from atom_models.testing import save_random_checkpoint
from atom_models.weights import iter_safetensors, safetensors_files


def _load_formats():
    path = Path(__file__).with_name("test_load_formats.py")
    spec = importlib.util.spec_from_file_location("atom_models_tests_load_formats", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LOAD_FORMATS = _load_formats()
ARCHITECTURES = LOAD_FORMATS.ARCHITECTURES
_bytes = LOAD_FORMATS._bytes


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    made: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            save_random_checkpoint(ARCHITECTURES[name](), made[name], max_shard_size="40KB")
        return made[name]

    return make


def test_plan_covers_every_byte_and_spans():
    entries = [("b", torch.float32, [4], 120, 16), ("a", torch.uint8, [100], 8, 100),
               ("c", torch.uint8, [0], 136, 0)]  # fmt: skip
    chunks, tensors = registered.plan([136, 64], [entries, [("d", torch.uint8, [56], 8, 56)]], 32)
    assert [(c.file, c.start, c.end) for c in chunks] == [
        (0, 0, 32), (0, 32, 64), (0, 64, 96), (0, 96, 128), (0, 128, 136), (1, 0, 32), (1, 32, 64),
    ]  # fmt: skip
    assert [(t.name, t.first_chunk, t.last_chunk) for t in tensors] == [
        ("a", 0, 3), ("b", 3, 4), ("c", 4, 4), ("d", 5, 6),
    ]  # fmt: skip
    assert registered.budget(tensors, 1) == 5  # "a" spans 4 chunks: 4 + 1
    assert registered.budget(tensors, 8) == 8


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
@pytest.mark.parametrize(("chunk", "ahead"), [(64, 1), (4096, 2)])
def test_cpu_walk_is_bit_equal_to_serial(sharded, name, chunk, ahead, monkeypatch):
    monkeypatch.setattr(registered, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(registered, "AHEAD_CHUNKS", ahead)
    path = sharded(name)
    assert len(safetensors_files(path)) >= 3
    serial = dict(iter_safetensors(path))
    got = dict(registered.iter_safetensors_registered(path, "cpu"))
    assert got.keys() == serial.keys()
    for key, tensor in got.items():
        assert (tensor.dtype, tensor.shape) == (serial[key].dtype, serial[key].shape), key
        assert torch.equal(_bytes(tensor), _bytes(serial[key])), key


def test_closing_early_stops_its_threads(sharded, monkeypatch):
    monkeypatch.setattr(registered, "CHUNK_BYTES", 64)
    monkeypatch.setattr(registered, "AHEAD_CHUNKS", 1)
    before = set(threading.enumerate())
    walk = registered.iter_safetensors_registered(sharded("llama"), "cpu")
    next(walk)
    walk.close()
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]


def test_headers_give_every_tensor(sharded):
    path = sharded("qwen3_moe")
    names = {e[0] for f in safetensors_files(path) for e in read_header(f)}
    assert names == {n for n, _ in registered.iter_safetensors_registered(path, "cpu")}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize(("chunk", "ahead"), [(64 << 10, 1), (256 << 20, 4)])
def test_registered_to_the_gpu_is_bit_equal_to_serial(sharded, name, chunk, ahead, monkeypatch):
    """The CUDA path (the page cache registered in chunks, DMA to the device) through
    load_model, bit-equal to the serial CPU reader, with chunks smaller than a shard."""
    monkeypatch.setattr(registered, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(registered, "AHEAD_CHUNKS", ahead)
    monkeypatch.setenv("ATOM_SAFETENSORS_DIRECT", "register")
    LOAD_FORMATS.assert_cuda_load_bit_equal_to_serial(sharded(name))
