"""Checkpoint loading: errors a user can act on, meta-device build, dtype/device placement."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from atom_models import CheckpointMismatchError, load_model, supported_architectures
from atom_models.registry import get_model_class
from atom_models.weights import safetensors_files

CONFIG = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    path, _ = make_checkpoint(LlamaConfig(**CONFIG))
    return path


def copy_checkpoint(src, dst, edit):
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    (file,) = safetensors_files(src)
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, dst / file.name, metadata={"format": "pt"})
    return dst


def test_unsupported_architecture_lists_supported(checkpoint, tmp_path):
    copy_checkpoint(checkpoint, tmp_path, lambda t: None)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM.*supported: .*LlamaForCausalLM"):
        load_model(tmp_path)
    assert "Qwen3ForCausalLM" in supported_architectures()
    with pytest.raises(ValueError, match="none given"):
        get_model_class(None)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    def drop(t):
        del t["model.layers.1.self_attn.k_proj.weight"]
        del t["model.norm.weight"]

    copy_checkpoint(checkpoint, tmp_path, drop)
    with pytest.raises(CheckpointMismatchError) as err:
        load_model(tmp_path)
    msg = str(err.value)
    assert "model.layers.1.self_attn.qkv_proj.weight (shards ['k'])" in msg
    assert "model.norm.weight" in msg


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    def add(t):
        t["model.layers.0.mlp.extra.weight"] = torch.ones(3)

    copy_checkpoint(checkpoint, tmp_path, add)
    with pytest.raises(
        CheckpointMismatchError, match="unexpected.*model.layers.0.mlp.extra.weight"
    ):
        load_model(tmp_path)


def test_wrong_shape_is_rejected(checkpoint, tmp_path):
    def shrink(t):
        t["model.layers.0.mlp.down_proj.weight"] = t["model.layers.0.mlp.down_proj.weight"][
            :, :8
        ].contiguous()

    copy_checkpoint(checkpoint, tmp_path, shrink)
    with pytest.raises(ValueError, match="shape"):
        load_model(tmp_path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="GGUF"):
        load_model(bogus)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_loads_in_requested_dtype_with_weights_equal(checkpoint, dtype):
    model = load_model(checkpoint, dtype=dtype)
    full = load_file(safetensors_files(checkpoint)[0])
    params = dict(model.named_parameters())
    assert all(p.dtype == dtype and p.device.type == "cpu" for p in params.values())
    assert not any(b.is_meta for b in model.buffers())
    assert torch.equal(params["model.norm.weight"], full["model.norm.weight"].to(dtype))
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    expected = torch.cat([full[f"model.layers.0.self_attn.{x}_proj.weight"] for x in "qkv"])
    assert torch.equal(qkv, expected.to(dtype))
    # The rotary cache stays fp32 whatever the weights' dtype.
    assert model.model.layers[0].self_attn.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_layers_share_one_rotary_cache(checkpoint):
    """Every layer's rotary cache is one tensor, built once for the model's arguments (the
    materializer keeps it shared), with the values `rope_cos_sin_cache` gives; another model of
    other rotary arguments gets its own."""
    import atom_kernels

    model = load_model(checkpoint, dtype=torch.float32)
    caches = {id(m.cos_sin_cache) for m in model.modules() if hasattr(m, "cos_sin_cache")}
    assert len(caches) == 1
    rotary = next(m for m in model.modules() if hasattr(m, "cos_sin_cache"))
    head = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    want = atom_kernels.rope_cos_sin_cache(head, rotary.cos_sin_cache.shape[0], 10000.0)
    torch.testing.assert_close(rotary.cos_sin_cache, want, rtol=0, atol=0)
    from atom_models.layers.rotary import get_rope

    assert get_rope(head, 64, 10000.0).cos_sin_cache is get_rope(head, 64, 10000.0).cos_sin_cache
    other = get_rope(head, 64, 500000.0).cos_sin_cache
    assert other is not get_rope(head, 64, 10000.0).cos_sin_cache
    assert not torch.equal(other, get_rope(head, 64, 10000.0).cos_sin_cache)


def test_materialize_moves_a_shared_buffer_once():
    from atom_models.loader import materialize

    shared = torch.arange(4.0)
    parts = [torch.nn.Module() for _ in range(3)]
    for part in parts:
        part.register_buffer("table", shared, persistent=False)
    model = torch.nn.Sequential(*parts)
    materialize(model, "meta", torch.float32)  # a new tensor on the target device each move
    assert parts[0].table is not shared and parts[0].table.is_meta
    assert all(part.table is parts[0].table for part in parts)
