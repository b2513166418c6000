"""Loading checkpoint tensors into a model by name.

One generic loader walks the checkpoint: a tensor whose name contains a key of the model's
`packed_modules_mapping` goes to the fused parameter with its shard id; any other goes to the
parameter of the same name. Each parameter's own `weight_loader` cuts its tensor-parallel slice.
A parameter marked `optional` may be absent from the checkpoint (it keeps its `default`); the
KV-cache scales of the attention layers are optional, and found under every name checkpoints
give them (see `_kv_scale_aliases`).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from atom_models.layers.linear import default_weight_loader

# Checkpoint tensors that are derived state, never weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's parameters."""


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    *,
    strict: bool = True,
    optional_modules: Collection[str] = (),
) -> set[str]:
    """Load `(checkpoint name, tensor)` pairs into `model`; returns the loaded parameter names
    (optional parameters the checkpoint lacks included: they hold their default).

    With `strict`, a checkpoint tensor that matches no parameter, or a parameter (or a shard of a
    packed parameter) that no tensor filled, raises `CheckpointMismatchError` naming them.
    `optional_modules` names modules (`model.layers.61`) a checkpoint may lack as a whole: one
    that no tensor loaded into is not missing and has no names in the result (the caller drops
    it); one partly loaded is checked like the rest.
    """
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    aliases = _kv_scale_aliases(params)
    index = _mapping_index(mapping)
    loaded_shards: dict[str, set] = {}
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        if name in aliases:
            param_name, shard_id = aliases[name], None
        else:
            param_name, shard_id = _target(name, index)
        param = params.get(param_name)
        if param is None:
            unexpected.append(name)
            continue
        try:
            if shard_id is None:
                filled = getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            else:
                filled = param.weight_loader(param, tensor, shard_id)
        except ValueError as e:
            raise CheckpointMismatchError(f"{name} -> {param_name}: {e}") from e
        # A loader may say which shards it filled: one fused tensor can fill every shard of a
        # packed parameter (3-D expert weights), or none (an expert another rank owns).
        loaded_shards.setdefault(param_name, set()).update({shard_id} if filled is None else filled)
    absent = tuple(
        f"{module}."
        for module in optional_modules
        if not any(name.startswith(f"{module}.") for name in loaded_shards)
    )
    params = {name: p for name, p in params.items() if not name.startswith(absent)}
    for param_name, param in params.items():
        if getattr(param, "optional", False) and param_name not in loaded_shards:
            with torch.no_grad():
                param.fill_(param.default)
            loaded_shards[param_name] = {None}  # filled with its default
    loaded = set(loaded_shards)
    if strict:
        missing = []
        for param_name, param in params.items():
            shards = loaded_shards.get(param_name)
            expected = set(getattr(param, "shard_ids", [None]))
            if shards is None:
                missing.append(param_name)
            elif not expected <= shards:
                missing.append(f"{param_name} (shards {sorted(map(str, expected - shards))})")
        if missing or unexpected:
            raise CheckpointMismatchError(_mismatch_message(missing, unexpected))
    return loaded


def _kv_scale_aliases(params: dict[str, nn.Parameter]) -> dict[str, str]:
    """Checkpoint names of the attention layers' KV-cache scales -> their parameters.

    For a layer `<attn>.attn` (the parameter `<attn>.attn.k_scale`), the scale is also found as
    `<attn>.k_scale` (compressed-tensors `kv_cache_scheme`, ModelOpt) and
    `<attn>.k_proj.output_scale` (older exports); the same for v.
    """
    aliases = {}
    for param_name in params:
        layer, _, leaf = param_name.rpartition(".")
        if leaf in ("k_scale", "v_scale") and getattr(params[param_name], "optional", False):
            parent = layer.rpartition(".")[0]
            aliases[f"{parent}.{leaf}"] = param_name
            aliases[f"{parent}.{leaf[0]}_proj.output_scale"] = param_name
    return aliases


def _target(name: str, index: dict[str, tuple[int, str, Any]]) -> tuple[str, Any]:
    """The parameter a checkpoint tensor loads into, and its shard id (None: not packed).

    A mapping key matches whole dotted components of the name, in its middle or at its end
    (`experts.0.w1.weight`, `experts.gate_up_proj`); the first matching key (in the mapping's
    order) wins. `index` is `_mapping_index(mapping)`: the name's spans of components are looked
    up, never the mapping scanned (a DeepSeek-V3 mapping has thousands of expert keys and its
    checkpoint ~10^5 tensors).
    """
    parts = name.split(".")
    best = None  # (order, start, end)
    for start in range(1, len(parts)):  # a key never starts the name
        for end in range(start + 1, len(parts) + 1):
            hit = index.get(".".join(parts[start:end]))
            if hit is not None and (best is None or hit[0] < best[0]):
                best = (hit[0], start, end)
    if best is None:
        return name, None
    order, start, end = best
    _, param_part, shard_id = index[".".join(parts[start:end])]
    return ".".join([*parts[:start], param_part, *parts[end:]]), shard_id


def _mapping_index(mapping: dict[str, tuple[str, Any]]) -> dict[str, tuple[int, str, Any]]:
    """key -> (its order in the mapping, param part, shard id)."""
    return {key: (order, *value) for order, (key, value) in enumerate(mapping.items())}


def _mismatch_message(missing: list[str], unexpected: list[str]) -> str:
    def listed(names: list[str]) -> str:
        head = ", ".join(names[:20])
        return head + (f", ... ({len(names)} in all)" if len(names) > 20 else "")

    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {listed(missing)}")
    if unexpected:
        parts.append(f"unexpected in the checkpoint: {listed(unexpected)}")
    return "checkpoint does not match the model; " + "; ".join(parts)


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files, from the index when there is one."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    return files


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the checkpoint's tensors one at a time (memory-mapped)."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_tensor(name)
