"""Build a model from a local checkpoint: HF directory (safetensors) or a `.gguf` file.

The model is built on the `meta` device (no memory), materialized once in the requested dtype on
the requested device, then filled from the checkpoint by name.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from atom_models.checkpoint import check_checkpoint, iter_checkpoint
from atom_models.distributed import TensorParallelGroup, tp_group
from atom_models.layers.attention import AttentionHost, attention_host
from atom_models.quantization import (
    parse_quant_config,
    process_weights_after_loading,
    quantize_model,
)
from atom_models.registry import get_model_class
from atom_models.remote_code import check_config_code


def load_config(model: str | Path, *, trust_remote_code: bool = False):
    """The HF config of a checkpoint directory or GGUF file. `trust_remote_code`: a checkpoint
    whose config.json names its own configuration class (`auto_map`) loads it (`remote_code`)."""
    path = Path(model)
    if path.is_file():
        from atom_models.gguf_file import gguf_hf_config, is_gguf

        if not is_gguf(path):
            raise ValueError(
                f"{path} is a file but not a GGUF file; pass a .gguf file or an HF directory"
            )
        return gguf_hf_config(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{path} is neither a .gguf file nor a Hugging Face checkpoint directory with a "
            "config.json (ATOM loads local checkpoints only)"
        )
    from transformers import AutoConfig

    config_dict = json.loads((path / "config.json").read_text())
    alias = _CONFIG_ALIASES.get(config_dict.get("model_type"))
    if alias is not None:
        return _aliased_config(path, config_dict, alias)
    check_config_code(path, config_dict, trust_remote_code)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


# Checkpoints whose config.json names a model_type transformers lacks (they ship their own
# configuration code, for trust_remote_code) but whose fields are those of a transformers config.
# They load this way whether trust_remote_code is set or not: the transformers class is the one
# ATOM's models are tested against; the checkpoint's own class may read its fields differently.
_CONFIG_ALIASES = {"kimi_k2": "deepseek_v3"}


def _aliased_config(path: Path, config_dict: dict, model_type: str):
    """The transformers config of `model_type` from config.json's fields, running no code."""
    from transformers import AutoConfig

    fields = {k: v for k, v in config_dict.items() if k not in ("model_type", "auto_map")}
    config = AutoConfig.for_model(model_type, **fields)
    config.name_or_path = str(path)
    return config


def iter_weights(model: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as `load_format="auto"` reads them (`checkpoint.py`)."""
    return iter_checkpoint(model)


def materialize(model: nn.Module, device: torch.device | str, dtype: torch.dtype) -> nn.Module:
    """Give every `meta` parameter real (uninitialized) storage, once; tied parameters stay tied.

    Computed buffers (rotary caches) were built for real and only move to `device`, a buffer
    shared by several modules once (they share the moved one). A parameter
    with a `fixed_dtype` attribute keeps that dtype (e.g. an fp32 router bias in a bf16 model);
    one that also has `values_dtype` gets the model's dtype there, for its loader to round the
    checkpoint's values to (an fp32 router weight holding what the bf16 model would).
    """
    replaced: dict[int, nn.Parameter] = {}
    moved: dict[int, torch.Tensor] = {}  # a buffer shared by modules (the rotary caches): once
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            new = replaced.get(id(param))
            if new is None:
                param_dtype = getattr(param, "fixed_dtype", None) or dtype
                data = torch.empty(param.shape, dtype=param_dtype, device=device)
                new = nn.Parameter(data, requires_grad=False)
                new.__dict__.update(param.__dict__)  # weight_loader, shard_ids
                if hasattr(param, "values_dtype"):  # held wider, valued as the model's dtype
                    new.values_dtype = dtype
                replaced[id(param)] = new
            setattr(module, name, new)
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf is not None:
                if buf.is_meta:
                    raise RuntimeError(f"buffer {name} of {type(module).__name__} is on meta")
                if id(buf) not in moved:
                    moved[id(buf)] = buf.to(device)
                module._buffers[name] = moved[id(buf)]
    return model


def build_model(
    hf_config,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallelGroup | None = None,
    host: AttentionHost | None = None,
) -> nn.Module:
    """Construct the ATOM model for `hf_config` with uninitialized weights on `device`.

    A quantized checkpoint's layers (its config's `quantization_config`) are built quantized;
    an unsupported or malformed quantization_config is a ValueError naming it.
    """
    cls = get_model_class(getattr(hf_config, "architectures", None))
    with contextlib.ExitStack() as stack:
        if tp is not None:
            stack.enter_context(tp_group(tp))
        if host is not None:
            stack.enter_context(attention_host(host))
        stack.enter_context(torch.device("meta"))
        model = cls(hf_config)
        quantize_model(model, parse_quant_config(hf_config), dtype)
    return materialize(model, device, dtype).eval()


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights (N(0, 0.02), norms 1) for benchmarks of real shapes without a checkpoint.

    Quantized weights get values of the same size: N(0, 1) in FP8 and int8 (random bytes in
    MXFP4) times scales of 0.02 (2^-7); packed 4/8-bit integers (GPTQ, AWQ, compressed-tensors)
    random words, with zero points in the middle of the range and scales that give std 0.02.
    """
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = getattr(p, "quant_kind", "weight")
            if hasattr(p, "int_role"):
                _dummy_int(p, gen)
            elif "norm" in name:
                p.fill_(1.0)
            elif p.dtype in (torch.float8_e4m3fn, torch.int8):
                # By slices of the first dim: a DeepSeek-V3 layer's 256 experts are 7.5e9 values,
                # whose float32 draw at once would take 30 GB.
                row = p.numel() // p.shape[0] if p.dim() and p.shape[0] else 1
                for part in p.view(-1, row).split(max(1, (1 << 28) // row), dim=0):
                    draw = torch.randn(part.shape, generator=gen, device=p.device)
                    part.copy_(draw.round() if p.dtype == torch.int8 else draw.to(p.dtype))
            elif p.dtype == torch.uint8:  # MXFP4 blocks, e8m0 scales
                if getattr(p, "packing", 1) == 2:
                    p.copy_(torch.randint(0, 256, p.shape, generator=gen, device=p.device))
                else:
                    p.fill_(127 - 7)
            elif kind != "weight":
                p.fill_(0.02)
            else:
                p.normal_(0.0, 0.02, generator=gen)
                if getattr(p, "values_dtype", None) is not None:  # an fp32 router weight
                    p.copy_(p.to(p.values_dtype))  # valued as the model's dtype, as if loaded
    process_weights_after_loading(model)


def _dummy_int(p: nn.Parameter, gen: torch.Generator) -> None:
    """A parameter of an integer checkpoint (`layers.int_checkpoint`), in the loaded layout."""
    if p.int_role == "qweight":  # uniform values: std 2**bits / sqrt(12) about the middle
        p.copy_(torch.randint(-(2**31), 2**31, p.shape, generator=gen, device=p.device))
    elif p.int_role == "scales":
        p.fill_(0.02 * 12**0.5 / 2**p.bits)
    elif p.int_role == "zeros":
        p.fill_(2 ** (p.bits - 1))
    else:  # g_idx: every input feature in group 0; weight_shape: dropped after loading
        p.zero_()


def load_model(
    model: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp: TensorParallelGroup | None = None,
    host: AttentionHost | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    load_format: str = "auto",
    trust_remote_code: bool = False,
    show_progress: bool = False,
) -> nn.Module:
    """Build and load the model of a local HF checkpoint directory or `.gguf` file.

    `load_format`: one of `checkpoint.LOAD_FORMATS` (ValueError otherwise, or when the
    checkpoint is not of that format); "dummy" needs only the config and fills the weights
    randomly (benchmarks). `show_progress`: a bar over the checkpoint's shards on stderr.
    Raises ValueError for an unsupported architecture (listing the supported ones) and
    `CheckpointMismatchError` naming missing or unexpected tensors. `trust_remote_code`: as
    `load_config`'s.
    """
    check_checkpoint(model, load_format)
    hf_config = load_config(model, trust_remote_code=trust_remote_code)
    built = build_model(hf_config, dtype=dtype, device=device, tp=tp, host=host)
    if load_format == "dummy":
        init_dummy_weights(built)
        return built
    with torch.no_grad():
        if weights is None:
            weights = iter_checkpoint(
                model,
                load_format,
                device=device,
                show_progress=show_progress,
                slices=tp is not None and tp.size > 1,  # each rank reads its ranges
            )
        try:
            built.load_weights(weights)
        finally:
            # A failed load ends the shard readers now (a traceback kept alive would otherwise
            # keep the generator, and its reader threads, from ever finishing).
            close = getattr(weights, "close", None)
            if close is not None:
                close()
    return built
