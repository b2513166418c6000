"""Load formats: which are accepted, the errors of the others, and the parallel safetensors read
(bit-equal to the serial one on multi-shard checkpoints of every architecture the suite builds)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from atom_models import load_model
from atom_models.checkpoint import LOAD_FORMATS, iter_safetensors_parallel
from atom_models.checkpoint_slice import CheckpointSlice
from atom_models.testing import save_random_checkpoint, write_quantized_checkpoint
from atom_models.weights import iter_safetensors, safetensors_files


def _configs(module: str, table: str = "CONFIGS") -> dict:
    path = Path(__file__).with_name(f"{module}.py")
    spec = importlib.util.spec_from_file_location(f"atom_models_tests_{module}", path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return getattr(loaded, table)


# One tiny config per architecture of test_parity.py and test_deepseek_v3.py.
_PARITY = _configs("test_parity")
_DEEPSEEK = _configs("test_deepseek_v3")
ARCHITECTURES = {
    "llama": _PARITY["llama-gqa-untied"],
    "qwen3": _PARITY["qwen3-untied-bias"],
    "qwen3_moe": _PARITY["qwen3_moe"],
    "mixtral": _PARITY["mixtral"],
    "glm4_moe": _PARITY["glm4_moe"],
    "gpt_oss": _PARITY["gpt_oss"],
    "deepseek_v3": _DEEPSEEK["v3-q-lora-yarn"],
    "deepseek_v2": _DEEPSEEK["v2-group-limited-yarn"],
}
# test_tensor_parallel.py's quantized checkpoints: name -> (config, quant config, quantize, select).
QUANTIZED = _configs("test_tensor_parallel", "QUANTIZED")
TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    def make(name: str) -> Path:
        path = tmp_path_factory.mktemp(name)
        save_random_checkpoint(ARCHITECTURES[name](), path, max_shard_size="40KB")
        return path

    return make


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_random_checkpoint(LlamaConfig(**TINY), path, max_shard_size="8KB")
    return path


def _bytes(t: torch.Tensor) -> torch.Tensor:  # bit for bit (NaN == NaN, -0.0 != 0.0)
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_parallel_load_is_bit_equal_to_serial(sharded, name):
    path = sharded(name)
    assert len(safetensors_files(path)) >= 3, "the checkpoint should have several shards"
    serial = load_model(path, weights=iter_safetensors(path))
    parallel = load_model(path, load_format="safetensors")
    auto = load_model(path)  # a directory: the same parallel read
    expected = dict(serial.named_parameters())
    for model in (parallel, auto):
        got = dict(model.named_parameters())
        assert got.keys() == expected.keys()
        for key, param in got.items():
            assert param.dtype == expected[key].dtype, key
            assert torch.equal(_bytes(param), _bytes(expected[key])), key


class FakeGroup:
    """Rank `rank` of 2 for building and loading only (no collective runs)."""

    def __init__(self, rank: int, expert_parallel: bool = False) -> None:
        self.rank, self.size = rank, 2
        self.enable_expert_parallel = expert_parallel
        self.pad_attention_heads = True  # as the engine's group

    def all_reduce(self, x):
        raise AssertionError("loading runs no collective")

    all_gather = all_reduce


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_tensor_parallel_ranks_read_by_range_bit_equal(sharded, name, monkeypatch):
    """Over 2 ranks each reads checkpoint ranges (`CheckpointSlice`); every rank's parameters
    are those the whole tensors give, with and without expert parallelism."""
    path = sharded(name)
    wholes = []
    whole = CheckpointSlice.whole
    monkeypatch.setattr(CheckpointSlice, "whole", lambda s: wholes.append(s._name) or whole(s))
    num_tensors = sum(1 for _ in iter_safetensors(path))
    is_moe = name not in ("llama", "qwen3")
    for group in [FakeGroup(0), FakeGroup(1), *([FakeGroup(1, True)] if is_moe else [])]:
        try:
            serial = load_model(path, tp=group, weights=iter_safetensors(path))
        except ValueError as e:  # a shape that does not split over 2 ranks
            pytest.skip(str(e))
        wholes.clear()
        sliced = load_model(path, tp=group)
        assert len(wholes) < num_tensors / 2, f"read whole: {wholes}"
        expected = dict(serial.named_parameters())
        got = dict(sliced.named_parameters())
        assert got.keys() == expected.keys()
        for key, param in got.items():
            assert torch.equal(_bytes(param), _bytes(expected[key])), (group.rank, key)


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_quantized_ranks_read_by_range_bit_equal(name, tmp_path):
    make_config, quant_config, quantize, select = QUANTIZED[name]
    src = tmp_path / "src"
    save_random_checkpoint(make_config(), src)
    path = write_quantized_checkpoint(src, tmp_path / "q", quant_config, quantize, select)
    for group in (FakeGroup(0), FakeGroup(1)):
        serial = dict(load_model(path, tp=group, weights=iter_safetensors(path)).named_parameters())
        sliced = dict(load_model(path, tp=group).named_parameters())
        assert sliced.keys() == serial.keys()
        for key, param in sliced.items():
            assert torch.equal(_bytes(param), _bytes(serial[key])), (group.rank, key)


def test_parallel_read_yields_every_tensor_once(llama):
    assert len(safetensors_files(llama)) >= 4
    serial = dict(iter_safetensors(llama))
    names = []
    for name, tensor in iter_safetensors_parallel(llama, max_threads=3):
        names.append(name)
        assert torch.equal(tensor, serial[name]), name
    assert sorted(names) == sorted(serial)


def test_parallel_read_stops_when_the_consumer_does(llama):
    reader = iter_safetensors_parallel(llama, max_threads=2)
    next(reader)
    reader.close()  # the reader threads end (the pool is joined), nothing hangs


def test_a_bad_shard_is_an_error(llama, tmp_path):
    for f in llama.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    safetensors_files(tmp_path)[1].write_bytes(b"not a safetensors file")
    with pytest.raises(Exception):  # noqa: B017 - safetensors' own error type
        list(iter_safetensors_parallel(tmp_path))


def test_unknown_format_lists_the_choices(llama):
    with pytest.raises(ValueError, match="load_format must be one of auto, safetensors, "):
        load_model(llama, load_format="pt")
    assert LOAD_FORMATS == ("auto", "safetensors", "fastsafetensors", "gguf", "dummy")


def test_safetensors_needs_safetensors_files(tmp_path):
    LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="load_format 'safetensors': no \\*.safetensors files"):
        load_model(tmp_path, load_format="safetensors")
    model = load_model(tmp_path, load_format="dummy")  # the config alone
    assert next(model.parameters()).abs().sum() > 0


def test_gguf_format_needs_a_gguf_file(llama):
    with pytest.raises(ValueError, match="load_format 'gguf' reads a .gguf file"):
        load_model(llama, load_format="gguf")


def test_safetensors_format_refuses_a_gguf_file():
    from atom_models.bundled import smollm2_gguf_path

    with pytest.raises(ValueError, match="reads a checkpoint directory"):
        load_model(smollm2_gguf_path(), load_format="safetensors")


HAS_FASTSAFETENSORS = importlib.util.find_spec("fastsafetensors") is not None


@pytest.mark.skipif(HAS_FASTSAFETENSORS, reason="fastsafetensors is installed")
def test_fastsafetensors_without_its_package_says_how_to_install(llama):
    with pytest.raises(ValueError, match="pip install fastsafetensors"):
        load_model(llama, load_format="fastsafetensors")


@pytest.mark.skipif(not HAS_FASTSAFETENSORS, reason="fastsafetensors is not installed")
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_fastsafetensors_load_is_bit_equal_to_serial(sharded, name):
    path = sharded(name)
    serial = dict(load_model(path, weights=iter_safetensors(path)).named_parameters())
    fast = dict(load_model(path, load_format="fastsafetensors").named_parameters())
    assert fast.keys() == serial.keys()
    for key, param in fast.items():
        assert torch.equal(_bytes(param), _bytes(serial[key])), key


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FASTSAFETENSORS, reason="fastsafetensors is not installed")
def test_fastsafetensors_to_the_gpu_is_bit_equal_to_serial(sharded):
    path = sharded("qwen3_moe")
    kwargs = dict(device="cuda", dtype=torch.bfloat16)
    serial = dict(load_model(path, weights=iter_safetensors(path), **kwargs).named_parameters())
    fast = dict(load_model(path, load_format="fastsafetensors", **kwargs).named_parameters())
    assert fast.keys() == serial.keys()
    for key, param in fast.items():
        assert param.device.type == "cuda", key
        assert torch.equal(_bytes(param), _bytes(serial[key])), key


def test_shard_bar_on_stderr_only_when_asked(llama, capfd):
    load_model(llama, show_progress=True)
    err = capfd.readouterr().err
    shards = len(safetensors_files(llama))
    assert "Loading safetensors checkpoint shards" in err and f"{shards}/{shards}" in err
    load_model(llama)
    assert "Loading safetensors" not in capfd.readouterr().err


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_direct_reader_headers_match_safetensors(sharded, name):
    """safetensors_direct's header parse gives each tensor's bytes exactly where safetensors
    reads them (the GPU path reads these ranges)."""
    from safetensors import safe_open

    from atom_models.safetensors_direct import read_header

    for path in safetensors_files(sharded(name)):
        raw = path.read_bytes()
        with safe_open(str(path), framework="pt") as f:
            entries = read_header(path)
            assert sorted(e[0] for e in entries) == sorted(f.keys())
            for name_, dtype, shape, offset, nbytes in entries:
                expected = f.get_tensor(name_)
                assert (dtype, shape) == (expected.dtype, list(expected.shape))
                got = torch.frombuffer(bytearray(raw[offset : offset + nbytes]), dtype=torch.uint8)
                assert torch.equal(got, _bytes(expected)), name_


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize(("chunk", "ring", "threads"), [(64, 2, 8), (64, 3, 16), (16 << 20, 2, 8)])
def test_direct_to_the_gpu_is_bit_equal_to_serial(sharded, name, chunk, ring, threads, monkeypatch):
    """The CUDA path (file -> a ring of pinned chunks -> device, several threads) loads every
    architecture bit-equal to the serial CPU reader, also with chunks smaller than a tensor."""
    import atom_models.safetensors_direct as direct

    monkeypatch.setattr(direct, "CHUNK_BYTES", chunk)
    monkeypatch.setattr(direct, "RING_CHUNKS", ring)
    monkeypatch.setattr(direct, "READ_THREADS", threads)
    assert_cuda_load_bit_equal_to_serial(sharded(name))


def assert_cuda_load_bit_equal_to_serial(path: Path) -> None:
    """load_model on the GPU (its CUDA reader, as the environment picks it) gives every
    parameter bit-equal to the serial CPU reader's."""
    kwargs = dict(device="cuda", dtype=torch.bfloat16)
    serial = dict(load_model(path, weights=iter_safetensors(path), **kwargs).named_parameters())
    fast = dict(load_model(path, **kwargs).named_parameters())
    assert fast.keys() == serial.keys()
    for key, param in fast.items():
        assert param.device.type == "cuda", key
        assert torch.equal(_bytes(param), _bytes(serial[key])), key
