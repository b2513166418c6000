"""Reading GGUF checkpoints (llama.cpp's format) as Hugging Face configs, tokenizers and weights.

GGUF names tensors `blk.{i}.attn_q.weight` and so on, stores 2-D shapes in ggml order (`[in, out]`,
the reverse of torch's), quantizes most matrices in blocks (Q4_1, Q8_0, K-quants, ...) and, for the
llama architecture only, reorders the rows of q/k so rotary embedding pairs are interleaved (gptj
style) rather than split in halves (HF's neox style). `iter_gguf_weights` undoes all of this and
yields tensors named and shaped exactly like the HF checkpoint, equal to what transformers' own GGUF
loader produces.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"

# GGUF `general.architecture` -> HF `architectures[0]`, `model_type`.
SUPPORTED_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# llama.cpp's converter permutes q/k rows only for these (LlamaModel.modify_tensors).
_QK_PERMUTED_ARCHITECTURES = {"llama"}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_TOP_TENSOR = re.compile(r"(\w+)\.(weight|bias)")

PathLike = str | os.PathLike


def is_gguf(path: PathLike) -> bool:
    """True when `path` is a file that starts with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except (OSError, TypeError):
        return False


def open_gguf(source: PathLike | Any):
    """A `gguf.GGUFReader` over `source` (a path, or a reader, returned as is).

    Parsing the metadata takes ~2 s for a 49k-token vocabulary; open once and pass the reader to
    `gguf_hf_config` and `iter_gguf_weights` when both are needed.
    """
    import gguf

    if isinstance(source, gguf.GGUFReader):
        return source
    path = Path(source).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not is_gguf(path):
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes b'GGUF')")
    stat = path.stat()
    return _cached_reader(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _cached_reader(path: str, mtime_ns: int, size: int):
    """Readers are read-only memory maps: one per file (and version) serves every caller.

    NOTE: loading the bundled SmolLM2 opened it 5 times (config twice, weights, tokenizer checks),
    26 s of the engine's 46 s start-up on the 2-core CI machine; cached, once.
    """
    import gguf

    return gguf.GGUFReader(path, "r")


def _field(reader, key: str, default: Any = None) -> Any:
    """A metadata value as a Python str / int / float / bool / list, or `default` when absent."""
    import gguf

    field = reader.fields.get(key)
    if field is None:
        return default

    def scalar(part, value_type):
        if value_type == gguf.GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == gguf.GGUFValueType.ARRAY:
        return [scalar(field.parts[i], field.types[-1]) for i in field.data]
    return scalar(field.parts[field.data[0]], field.types[0])


def gguf_architecture(source: PathLike | Any) -> str:
    """The file's `general.architecture`, checked against SUPPORTED_ARCHITECTURES."""
    reader = open_gguf(source)
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported by ATOM; supported GGUF architectures: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}. Convert the original Hugging Face "
            "checkpoint instead, or use a GGUF of a supported architecture."
        )
    return arch


def _hf_shape(tensor) -> tuple[int, ...]:
    # ggml lists dimensions fastest-varying first; torch slowest first.
    return tuple(int(d) for d in reversed(tensor.shape))


def gguf_hf_config(source: PathLike | Any):
    """A transformers `PretrainedConfig` (Llama / Qwen2 / Qwen3) built from the GGUF metadata."""
    from transformers import CONFIG_MAPPING

    reader = open_gguf(source)
    arch = gguf_architecture(reader)
    architecture, model_type = SUPPORTED_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            "This GGUF carries `rope_freqs.weight` (llama3-style rope scaling), whose parameters "
            "GGUF does not record; it is not supported. Use the original Hugging Face checkpoint."
        )

    def meta(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden_size = meta("embedding_length")
    num_heads = meta("attention.head_count")
    num_kv_heads = meta("attention.head_count_kv", num_heads)
    if isinstance(num_kv_heads, list):
        raise ValueError("GGUF files with a per-layer KV head count are not supported")
    # llama.cpp writes key_length only when it differs from hidden / heads (Qwen3 always writes it).
    head_dim = meta("attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta("rope.dimension_count")
    if head_dim is None:
        head_dim = hidden_size // num_heads

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        vocab_size = len(tokens.data)
    else:
        vocab_size = meta("vocab_size") or _hf_shape(tensors["token_embd.weight"])[0]

    kwargs: dict[str, Any] = dict(
        architectures=[architecture],
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=meta("feed_forward_length"),
        num_hidden_layers=meta("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    if arch == "llama":
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "qwen2":
        del kwargs["head_dim"]  # Qwen2 derives it; its config has no such field
    rope_scaling = _rope_scaling(meta)
    if rope_scaling is not None:
        kwargs["rope_scaling"] = rope_scaling
    return CONFIG_MAPPING[model_type](**kwargs)


def _rope_scaling(meta) -> dict[str, Any] | None:
    scaling_type = meta("rope.scaling.type", "none")
    if scaling_type == "none":
        return None
    factor = float(meta("rope.scaling.factor", 1.0))
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": factor}
    if scaling_type == "yarn":
        return {
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": meta("rope.scaling.original_context_length"),
        }
    raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported (linear, yarn)")


def gguf_tokenizer(path: PathLike):
    """The file's tokenizer as a transformers fast tokenizer, chat template included.

    Built offline by transformers from the GGUF vocabulary, merges and `tokenizer.chat_template`.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_file() or not is_gguf(path):
        open_gguf(path)  # clear errors for a missing / non-GGUF path before transformers' own
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def gguf_hf_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor name, or None when there is no counterpart."""
    if m := _BLOCK_TENSOR.fullmatch(gguf_name):
        layer, leaf, kind = m.groups()
        hf_leaf = _BLOCK_NAMES.get(leaf)
        return None if hf_leaf is None else f"model.layers.{layer}.{hf_leaf}.{kind}"
    if m := _TOP_TENSOR.fullmatch(gguf_name):
        leaf, kind = m.groups()
        hf_leaf = _TOP_LEVEL_NAMES.get(leaf)
        return None if hf_leaf is None else f"{hf_leaf}.{kind}"
    return None


def _unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation: per head, interleaved rotary pairs -> two halves.

    llama.cpp: `w.reshape(H, 2, D // 2, ...).swapaxes(1, 2)`; this is its inverse.
    """
    # H = heads, D = head dim
    rows = w.shape[0]
    x = w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])  # [H, D/2, 2, ...]
    return x.transpose(1, 2).reshape(w.shape)  # [H * D, ...], halves per head


def iter_gguf_weights(
    source: PathLike | Any, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` for every weight of the file, one at a time, in file order.

    Tensors are dequantized (gguf.quants.dequantize, to float32), shaped as in the HF checkpoint,
    q/k rows un-permuted for llama, then cast to `dtype`. `lm_head.weight` is yielded only when the
    file has an `output.weight` (otherwise the embeddings are tied).
    """
    from gguf.quants import dequantize

    reader = open_gguf(source)
    arch = gguf_architecture(reader)
    config = gguf_hf_config(reader) if arch in _QK_PERMUTED_ARCHITECTURES else None
    for tensor in reader.tensors:
        hf_name = gguf_hf_name(tensor.name)
        if hf_name is None:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} ({arch}) has no Hugging Face counterpart known to "
                "ATOM"
            )
        array = dequantize(tensor.data, tensor.tensor_type)  # float32, torch order
        if not array.flags.writeable:  # an unquantized tensor is a view of the memory map
            array = np.array(array)
        weight = torch.from_numpy(array).reshape(_hf_shape(tensor))
        if config is not None and ".self_attn.q_proj." in hf_name:
            weight = _unpermute_rows(weight, config.num_attention_heads)
        elif config is not None and ".self_attn.k_proj." in hf_name:
            weight = _unpermute_rows(weight, config.num_key_value_heads)
        yield hf_name, weight.to(dtype).contiguous()
