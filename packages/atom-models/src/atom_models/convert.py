"""Convert a GGUF file into a Hugging Face checkpoint directory.

    python -m atom_models.convert MODEL.gguf OUT_DIR [--dtype bfloat16] [--max-shard-size 2GB]

Writes config.json, model.safetensors (or model-0000i-of-0000n.safetensors shards plus
model.safetensors.index.json), the tokenizer files and generation_config.json. Weights are
dequantized one tensor at a time, so peak memory is about one shard.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from atom_models.gguf_file import (
    PathLike,
    gguf_hf_config,
    gguf_tokenizer,
    iter_gguf_weights,
    open_gguf,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SIZE_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}  # fmt: skip
SAFETENSORS_NAME = "model.safetensors"
SAFETENSORS_INDEX_NAME = "model.safetensors.index.json"


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string like "2GB", "500MB", "1.5GiB" (GB = 10**9, as HF)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", size, flags=re.IGNORECASE)
    if m is None:
        raise ValueError(f"Cannot parse size {size!r}; use e.g. 2GB, 500MB, 1GiB or a byte count")
    return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").upper()])


def _write_shards(weights, out_dir: Path, max_shard_bytes: int) -> list[tuple[Path, list[str]]]:
    """Write safetensors files of at most `max_shard_bytes` each (a bigger tensor gets its own).

    Shards are written under temporary names, since the final names carry the shard count.
    Returns (path, tensor names) per shard.
    """
    from safetensors.torch import save_file

    shards: list[tuple[Path, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush():
        nonlocal shard, shard_bytes
        path = out_dir / f".{SAFETENSORS_NAME}.part{len(shards):05d}"
        save_file(shard, str(path), metadata={"format": "pt"})
        shards.append((path, list(shard)))
        shard, shard_bytes = {}, 0

    for name, tensor in weights:
        num_bytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + num_bytes > max_shard_bytes:
            flush()
        shard[name] = tensor
        shard_bytes += num_bytes
    if shard or not shards:
        flush()
    return shards


def _finalize_shards(shards: list[tuple[Path, list[str]]], out_dir: Path, total_size: int) -> None:
    """Give the shards their final names; write the index when there is more than one."""
    if len(shards) == 1:
        shards[0][0].replace(out_dir / SAFETENSORS_NAME)
        return
    weight_map: dict[str, str] = {}
    for i, (part, names) in enumerate(shards):
        shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        part.replace(out_dir / shard_name)
        weight_map.update(dict.fromkeys(names, shard_name))
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    text = json.dumps(index, indent=2, sort_keys=True) + "\n"
    (out_dir / SAFETENSORS_INDEX_NAME).write_text(text)


def convert_gguf_to_hf(
    gguf_path: PathLike,
    out_dir: PathLike,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str = "2GB",
) -> Path:
    """Write a Hugging Face checkpoint of the GGUF file `gguf_path` into `out_dir`; return out_dir.

    Weights are stored in `dtype` (dequantized from the GGUF blocks); above `max_shard_size` bytes
    the safetensors file is split into shards with an index, as `save_pretrained` does.
    """
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    max_shard_bytes = parse_size(max_shard_size)
    reader = open_gguf(gguf_path)
    config = gguf_hf_config(reader)
    config.dtype = dtype
    tokenizer = gguf_tokenizer(gguf_path)

    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [out_dir / SAFETENSORS_NAME, out_dir / SAFETENSORS_INDEX_NAME]:
        stale.unlink(missing_ok=True)
    for stale in out_dir.glob("model-*-of-*.safetensors"):
        stale.unlink()

    total_size = 0

    def weights():
        nonlocal total_size
        for name, tensor in iter_gguf_weights(reader, dtype=dtype):
            total_size += tensor.numel() * tensor.element_size()
            yield name, tensor

    shards = _write_shards(weights(), out_dir, max_shard_bytes)
    _finalize_shards(shards, out_dir, total_size)
    config.save_pretrained(out_dir)
    GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m atom_models.convert",
        description="Convert a GGUF file into a Hugging Face checkpoint directory (dequantized).",
    )
    parser.add_argument("gguf_path", help="the .gguf file (llama, qwen2 or qwen3 architecture)")
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--max-shard-size", default="2GB", help="e.g. 2GB, 500MB (default 2GB)")
    args = parser.parse_args(argv)
    out = convert_gguf_to_hf(
        args.gguf_path, args.out_dir, dtype=DTYPES[args.dtype], max_shard_size=args.max_shard_size
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
