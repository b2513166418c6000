"""The tokenizer of a checkpoint directory or GGUF file, and its end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """The tokenizer of a checkpoint directory (its own code only with `trust_remote_code`:
    `atom_models.remote_code`) or of a GGUF file."""
    path = Path(model)
    if path.is_file():
        from atom_models.gguf_file import gguf_tokenizer

        return gguf_tokenizer(path)
    from transformers import AutoTokenizer

    from atom_models.remote_code import check_tokenizer_code

    check_tokenizer_code(path, trust_remote_code)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, list | tuple | set) else {int(value)}


def eos_token_ids(model: str, hf_config, tokenizer) -> set[int]:
    """EOS ids from the generation config when there is one, else the model config and tokenizer."""
    generation_config = Path(model) / "generation_config.json"
    if generation_config.is_file():
        ids = _as_set(json.loads(generation_config.read_text()).get("eos_token_id"))
        if ids:
            return ids
    ids = _as_set(getattr(hf_config, "eos_token_id", None))
    return ids | (_as_set(tokenizer.eos_token_id) if tokenizer is not None else set())
