"""SGLang's ServerArgs / ModelConfig -> AtomSglangConfig, one test per field, on objects SGLang
itself builds from its server arguments (the same path `launch_server` flags take)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from atom_sglang_plugin.config import AtomSglangConfig


@pytest.fixture
def translate(tiny_llama, make_server_args, model_config):
    """`translate(**server_args) -> AtomSglangConfig` for the tiny checkpoint."""

    def run(**overrides):
        args = make_server_args(tiny_llama[0], model_impl="atom", **overrides)
        return AtomSglangConfig.from_sglang(args, model_config(tiny_llama[0], **overrides))

    return run


def test_model(translate, tiny_llama):
    assert translate().model == str(tiny_llama[0])


@pytest.mark.parametrize(
    ("flag", "dtype"), [("float32", torch.float32), ("bfloat16", torch.bfloat16)]
)
def test_dtype(translate, flag, dtype):
    assert translate(dtype=flag).dtype == dtype


def test_device(translate):
    assert translate().device == "cpu"


def test_context_length(translate):
    assert translate().context_length == 256  # the checkpoint's max_position_embeddings
    assert translate(context_length=128).context_length == 128


def test_tp_size(translate):
    assert translate().tp_size == 1


def test_ep_size(translate):
    assert translate().ep_size == 1


def test_attention_backend(translate):
    assert translate().attention_backend == "torch_native"


def test_kv_cache_dtype(translate):
    assert translate().kv_cache_dtype == "auto"


def test_page_size(translate):
    assert translate().page_size == 1
    assert translate(page_size=16).page_size == 16


def test_max_running_requests(translate):
    assert translate(max_running_requests=7).max_running_requests == 7


def test_chunked_prefill_size(translate):
    assert translate(chunked_prefill_size=512).chunked_prefill_size == 512


def test_mem_fraction_static(translate):
    assert translate(mem_fraction_static=0.5).mem_fraction_static == 0.5


def test_radix_cache(translate):
    assert translate().radix_cache is True
    assert translate(disable_radix_cache=True).radix_cache is False


def test_summary_names_every_field(translate):
    summary = translate().summary()
    for key in ("dtype=float32", "device=cpu", "context_length=256", "tp=1", "ep=1",
                "attention_backend=torch_native", "kv_cache_dtype=auto", "page_size=1",
                "radix_cache=True"):  # fmt: skip
        assert key in summary


def test_refuses_pipeline_parallelism(tiny_llama, make_server_args, model_config):
    args = SimpleNamespace(**vars(make_server_args(tiny_llama[0])))
    args.pp_size = 2
    with pytest.raises(ValueError, match="pipeline parallelism.*drop --model-impl atom"):
        AtomSglangConfig.from_sglang(args, model_config(tiny_llama[0]))


def test_refuses_quantized_checkpoints(tiny_llama, make_server_args, model_config):
    config = model_config(tiny_llama[0])
    config.quantization = "fp8"
    with pytest.raises(ValueError, match="unquantized checkpoints only.*'fp8'"):
        AtomSglangConfig.from_sglang(make_server_args(tiny_llama[0]), config)
