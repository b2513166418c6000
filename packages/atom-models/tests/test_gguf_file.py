"""GGUF reading, checked against transformers' own GGUF loader and against llama.cpp's layout.

The bundled SmolLM2 file (llama, Q4_1 + Q8_0) is the real-world case; tiny files written here with
gguf's writer cover what it lacks (qwen2 biases, qwen3 q/k norms, an untied LM head, GQA with
llama's q/k permutation).
"""

from __future__ import annotations

import inspect

import gguf
import numpy as np
import pytest
import torch

from atom_models.gguf_file import (
    gguf_hf_config,
    gguf_tokenizer,
    is_gguf,
    iter_gguf_weights,
    open_gguf,
)

CONFIG_FIELDS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    "pad_token_id",
]  # fmt: skip


@pytest.fixture(scope="module")
def reader(bundled):
    return open_gguf(bundled)  # parsing the metadata takes seconds: share it


@pytest.fixture(scope="module")
def reference_state(reference):
    return reference.state_dict()


def test_is_gguf(bundled, tmp_path):
    assert is_gguf(bundled)
    (tmp_path / "x.gguf").write_text("not a gguf")
    assert not is_gguf(tmp_path / "x.gguf")
    assert not is_gguf(tmp_path / "missing.gguf")
    assert not is_gguf(tmp_path)


def test_config_matches_transformers(reader, reference):
    ours = gguf_hf_config(reader)
    ref = reference.config  # AutoConfig.from_pretrained(dir, gguf_file=name)
    for field in CONFIG_FIELDS:
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rope_parameters["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert ours.architectures == ["LlamaForCausalLM"]
    assert ours.tie_word_embeddings and ours.vocab_size == 49152


def test_weights_equal_transformers(reader, reference_state):
    weights = iter_gguf_weights(reader)
    assert inspect.isgenerator(weights)  # streamed, not materialized
    names = []
    for name, tensor in weights:
        names.append(name)
        ref = reference_state[name]
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert tensor.shape == ref.shape, (name, tensor.shape, ref.shape)
        assert torch.equal(tensor, ref), name
    assert len(names) == len(set(names))
    # The file has no output.weight: the LM head is the (tied) embedding.
    assert set(names) == set(reference_state) - {"lm_head.weight"}


def test_dtype_is_applied_after_dequantization(reader, reference_state):
    name, tensor = next(
        (n, t)
        for n, t in iter_gguf_weights(reader, dtype=torch.bfloat16)
        if n.endswith("k_proj.weight")
    )
    assert tensor.dtype == torch.bfloat16
    assert torch.equal(tensor, reference_state[name].to(torch.bfloat16))


def test_tokenizer(bundled, reader):
    tok = gguf_tokenizer(bundled)
    config = gguf_hf_config(reader)
    text = "Hello, world! The café costs 3.50 €\n\tright?"
    ids = tok(text).input_ids
    assert ids and tok.decode(ids) == text
    assert tok.eos_token_id == config.eos_token_id == 2
    assert tok.bos_token_id == config.bos_token_id == 1
    assert tok.eos_token == "<|im_end|>"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        gguf_hf_config(bad)
    with pytest.raises(ValueError, match="not a GGUF file"):
        next(iter_gguf_weights(bad))
    with pytest.raises(FileNotFoundError):
        gguf_hf_config(tmp_path / "missing.gguf")


# --- tiny files in llama.cpp's layout -------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (q: all heads, k: KV heads)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(path, arch: str, config, state: dict[str, torch.Tensor], quantized=()) -> None:
    """Write an HF state dict as llama.cpp would: gguf names, q/k permuted for llama."""
    arch_enum = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    name_map = gguf.get_tensor_name_map(arch_enum, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == "qwen3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for hf_name, tensor in state.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, kind = hf_name.rsplit(".", 1)
        data = tensor.numpy()
        if arch == "llama" and base.endswith("q_proj"):
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and base.endswith("k_proj"):
            data = llama_cpp_permute(data, config.num_key_value_heads)
        gguf_name = f"{name_map.get_name(base)}.{kind}"
        if hf_name in quantized:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_config(model_type: str, tie: bool):
    from transformers import CONFIG_MAPPING

    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    return CONFIG_MAPPING[model_type](
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, rope_theta=50000.0, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    "model_type, tie", [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False)]
)
def test_tiny_roundtrip(tmp_path, model_type, tie):
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, tie)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # distinct, non-trivial values everywhere (biases and norms included)
    state = model.state_dict()
    quantized = {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"}
    path = tmp_path / f"{model_type}.gguf"
    write_gguf(path, model_type, config, state, quantized=quantized)

    ours = gguf_hf_config(path)
    for field in CONFIG_FIELDS:
        if field == "rms_norm_eps":  # stored as float32
            assert ours.rms_norm_eps == pytest.approx(config.rms_norm_eps, rel=1e-6)
        elif field != "pad_token_id":  # (qwen2 has no head_dim field)
            assert getattr(ours, field, None) == getattr(config, field, None), field
    assert ours.rope_parameters["rope_theta"] == 50000.0
    assert ours.architectures == [type(model).__name__]

    weights = dict(iter_gguf_weights(path))
    expected = set(state) - ({"lm_head.weight"} if tie else set())
    assert set(weights) == expected
    for name, tensor in weights.items():
        ref = state[name]
        if name in quantized:  # Q8_0 quantizes along rows, so it commutes with the row permutation
            q8 = gguf.GGMLQuantizationType.Q8_0
            deq = gguf.quants.dequantize(gguf.quants.quantize(ref.numpy(), q8), q8)
            ref = torch.from_numpy(deq)
            assert not torch.equal(ref, state[name])  # the quantized path is really exercised
        assert tensor.shape == ref.shape, name
        assert torch.equal(tensor, ref), name


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert is_gguf(path)
    with pytest.raises(ValueError, match=r"'gpt2' is not supported.*llama, qwen2, qwen3"):
        gguf_hf_config(path)
    with pytest.raises(ValueError, match=r"'gpt2' is not supported"):
        next(iter_gguf_weights(path))
