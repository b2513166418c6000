"""Real architectures' shapes (random weights: no downloads on the GPU machine)."""

from __future__ import annotations

import tempfile
from pathlib import Path


def llama3_8b():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        bos_token_id=128000,
        eos_token_id=128001,
    )


def qwen3_0_6b():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        architectures=["Qwen3ForCausalLM"],
        bos_token_id=151643,
        eos_token_id=151645,
    )


SHAPES = {"llama3-8b": llama3_8b, "qwen3-0.6b": qwen3_0_6b}


def config_dir(name: str, tokenizer_dir: str | None = None, out: str | None = None) -> str:
    """A directory with config.json for `name` (for load_format='dummy').

    With `tokenizer_dir`, its tokenizer files are copied in and the vocabulary is cut to the
    tokenizer's size, so a server can take text prompts (the serving benchmark).
    """
    import shutil

    path = Path(out) if out else Path(tempfile.mkdtemp(prefix=f"atom-{name}-"))
    path.mkdir(parents=True, exist_ok=True)
    config = SHAPES[name]()
    if tokenizer_dir:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config.vocab_size = len(tokenizer)
        config.eos_token_id = tokenizer.eos_token_id
        config.bos_token_id = tokenizer.bos_token_id
        for f in Path(tokenizer_dir).iterdir():
            shutil.copy(f, path / f.name)
    config.save_pretrained(path)
    return str(path)


if __name__ == "__main__":
    import sys

    print(config_dir(sys.argv[1], *sys.argv[2:]))
