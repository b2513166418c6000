"""What a checkpoint's `quantization_config` says, normalized.

Every supported format is read from config.json, never from a flag, into one `QuantConfig`: the
scheme of the quantized linear layers, the scheme of the experts, and which modules stay in the
activation dtype; or, for a checkpoint whose config groups quantize modules differently
(compressed-tensors `config_groups`), each group's scheme and the modules it targets. Integer
formats (GPTQ, AWQ, compressed-tensors int) are parsed in `int_config`. An unsupported method,
or a config ATOM cannot honour exactly, is a ValueError naming it and listing what ATOM loads.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

SUPPORTED = (
    "fp8 (block-wise `weight_block_size`, or per-tensor), "
    "compressed-tensors (float-quantized FP8: per-tensor, per-channel or block weights), "
    "modelopt (FP8), mxfp4 (GPT-OSS experts), "
    "compressed-tensors int-quantized (INT8 weights per channel/tensor with INT8 activations, "
    "dynamic per token or static per tensor; linear layers only), "
    "compressed-tensors pack-quantized (4/8-bit int weights, group or channel, symmetric or "
    "asymmetric, actorder g_idx in linear layers), "
    "gptq (4/8-bit, group_size or -1, desc_act in linear layers, sym or asym, checkpoint_format "
    "'gptq' or 'gptq_v2'), awq (4-bit, version 'gemm', zero_point)"
)

# Weight formats of a quantized module.
FP8_BLOCK = "fp8_block"  # float8_e4m3fn weight, fp32 scale per [bn, bk] block
FP8_CHANNEL = "fp8_channel"  # float8_e4m3fn weight, fp32 scale per output channel
FP8_TENSOR = "fp8_tensor"  # float8_e4m3fn weight, one fp32 scale (per checkpoint tensor)
MXFP4 = "mxfp4"  # e2m1 pairs in uint8, e8m0 scale per 32 values
INT8 = "int8"  # int8 weight, fp32 scale per channel (or tensor); int8 activations (W8A8)
WNA16 = "wna16"  # 4/8-bit ints packed in int32, scale (and zero) per group; float activations


@dataclass(frozen=True)
class QuantScheme:
    """How one kind of module (linear layers, or experts) is stored and computed."""

    weight: str  # FP8_BLOCK | FP8_CHANNEL | FP8_TENSOR | MXFP4 | INT8 | WNA16
    block_size: tuple[int, int] | None = None  # [bn, bk] for FP8_BLOCK
    static_input_scale: bool = False  # a per-tensor `input_scale` in the checkpoint
    scale_name: str = "weight_scale"  # checkpoint suffix of the weight scale
    channel_scale: bool = True  # INT8: a scale per channel (False: per tensor)
    # WNA16: how the checkpoint stores it (`atom_models.layers.int_checkpoint.FORMATS`)
    checkpoint: str = ""  # "ct" | "gptq" | "gptq_v2" | "awq"
    bits: int = 0
    group_size: int = -1  # -1: one group per row (channel-wise)
    symmetric: bool = True  # False: zero points in the checkpoint
    g_idx: bool = False  # the checkpoint holds each input feature's group (act-order)


@dataclass(frozen=True)
class QuantConfig:
    method: str  # quant_method as config.json spells it
    linear: QuantScheme | None  # None: linear layers stay unquantized
    moe: QuantScheme | None  # None: experts stay unquantized
    ignore: tuple[str, ...] = ()  # modules left unquantized (names, globs, "re:" regexes)
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors: which linear layers it covers
    kv_cache_scheme: dict[str, Any] | None = field(default=None, compare=False)
    # Several schemes, each for the modules its targets name (compressed-tensors config_groups,
    # GPTQ / AWQ): when set, `linear` / `moe` are not read.
    groups: tuple[tuple[QuantScheme, tuple[str, ...]], ...] = ()

    def linear_scheme(self, names: list[str]) -> QuantScheme | None:
        """The scheme of a linear layer loaded from checkpoint modules `names` (None: stays in
        the activation dtype)."""
        if not self.groups:
            return None if self.linear is None or self.is_ignored(names) else self.linear
        return self._group_scheme(names)

    def moe_scheme(self, name: str, expert_names: list[str]) -> QuantScheme | None:
        """The scheme of the FusedMoE `name` whose first expert loads from `expert_names`."""
        if not self.groups:
            if self.moe is None:
                return None
            by_name = "Linear" in self.targets  # else the targets name the experts' modules
            return None if self.is_ignored([name] if by_name else expert_names) else self.moe
        if any(_matches(name, p) for p in self.ignore):
            return None
        return self._group_scheme(expert_names)

    def _group_scheme(self, names: list[str]) -> QuantScheme | None:
        schemes = [None if any(_matches(n, p) for p in self.ignore) else self._target(n)
                   for n in names]  # fmt: skip
        if any(s != schemes[0] for s in schemes):
            raise ValueError(
                f"quantization_config: the modules {names} are fused into one layer but are not "
                "quantized alike (schemes or ignore lists differ); ATOM cannot load that checkpoint"
            )
        return schemes[0]

    def _target(self, name: str) -> QuantScheme | None:
        """The group naming `name` itself (a name or regex) wins over a "Linear" group."""
        for specific in (True, False):
            for scheme, targets in self.groups:
                for t in targets:
                    if (t != "Linear" and _matches(name, t)) if specific else t == "Linear":
                        return scheme
        return None

    def is_ignored(self, names: list[str]) -> bool:
        """Whether a module (known by its ATOM name and its checkpoint names) stays unquantized.

        A packed module (qkv_proj from q/k/v_proj) must be ignored for all of its checkpoint
        modules or for none: anything else cannot be one fused weight.
        """
        ignored = [any(_matches(n, p) for p in self.ignore) for n in names]
        targeted = [any(t == "Linear" or _matches(n, t) for t in self.targets) for n in names]
        skip = [i or not t for i, t in zip(ignored, targeted, strict=True)]
        if any(skip) and not all(skip):
            raise ValueError(
                f"quantization_config: the modules {names} are fused into one layer but only "
                "some of them are quantized; ATOM cannot load that checkpoint"
            )
        return all(skip)


def _matches(name: str, pattern: str) -> bool:
    """compressed-tensors' "re:" regexes, HF's globs ("model.layers.*.self_attn"), module
    names and their suffixes ("lm_head", "mlp.gate")."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return (
        name == pattern
        or name.endswith("." + pattern)
        or fnmatch(name, pattern)
        or fnmatch(name, pattern + ".*")
        or name.startswith(pattern + ".")
    )


def quantization_config_of(hf_config) -> dict[str, Any] | None:
    """The raw `quantization_config` of an HF config, as a dict (None: unquantized)."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict() if hasattr(raw, "to_dict") else vars(raw)
    return raw or None


def parse_quant_config(hf_config) -> QuantConfig | None:
    """The checkpoint's quantization, or None for an unquantized checkpoint."""
    raw = quantization_config_of(hf_config)
    if raw is None:
        return None
    method = raw.get("quant_method")
    parser = _PARSERS.get(str(method).lower() if method is not None else None)
    if parser is None:
        raise ValueError(
            f"quantization_config: quant_method {method!r} is not supported; ATOM loads {SUPPORTED}"
        )
    return parser(raw)


def _malformed(method: str, what: str) -> ValueError:
    return ValueError(f"quantization_config ({method}): {what}; ATOM loads {SUPPORTED}")


def _block_size(method: str, value: Any) -> tuple[int, int]:
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        raise _malformed(method, f"the block size must be two positive ints, got {value!r}")
    return int(value[0]), int(value[1])


def _names(method: str, raw: dict, key: str) -> tuple[str, ...]:
    value = raw.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _malformed(method, f"{key} must be a list of module names, got {value!r}")
    return tuple(value)


def _parse_fp8(raw: dict) -> QuantConfig:
    method = "fp8"
    scheme_name = raw.get("activation_scheme", "dynamic")
    if scheme_name not in ("dynamic", "static"):
        raise _malformed(
            method, f"activation_scheme must be 'dynamic' or 'static', got {scheme_name!r}"
        )
    ignore = _names(method, raw, "modules_to_not_convert") + _names(method, raw, "ignored_layers")
    if raw.get("weight_block_size") is not None:
        block = _block_size(method, raw["weight_block_size"])
        if scheme_name != "dynamic":
            raise _malformed(method, "block-wise FP8 needs activation_scheme 'dynamic'")
        scheme = QuantScheme(FP8_BLOCK, block, scale_name="weight_scale_inv")
    else:  # vLLM's per-tensor FP8 checkpoints
        scheme = QuantScheme(FP8_TENSOR, static_input_scale=scheme_name == "static")
    return QuantConfig(method, scheme, scheme, ignore)


def _parse_compressed_tensors(raw: dict) -> QuantConfig:
    from atom_models.quantization.int_config import CT_FORMATS, ct_int_scheme

    method = "compressed-tensors"
    fmt = raw.get("format")
    if fmt not in CT_FORMATS:
        raise _malformed(method, f"format {fmt!r} is not supported")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _malformed(method, "config_groups must be a non-empty mapping")
    by_group, targets = [], []
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise _malformed(method, f"config group {name!r} has no weights scheme")
        group_fmt = group.get("format") or fmt
        if group.get("weights", {}).get("type") == "int":
            scheme = ct_int_scheme(name, group, group_fmt)
        else:
            if group_fmt not in (None, "float-quantized", "naive-quantized"):
                raise _malformed(method, f"config group {name!r}: float weights in {group_fmt!r}")
            scheme = _compressed_scheme(name, group)
        group_targets = group.get("targets") or ["Linear"]
        if not isinstance(group_targets, list) or not all(
            isinstance(t, str) for t in group_targets
        ):
            raise _malformed(method, f"config group {name!r}: targets must be a list of strings")
        by_group.append((scheme, tuple(group_targets)))
        targets += group_targets
    kv = raw.get("kv_cache_scheme")
    ignore = _names(method, raw, "ignore")
    schemes = {scheme for scheme, _ in by_group}
    if len(schemes) == 1:
        scheme = schemes.pop()
        return QuantConfig(method, scheme, scheme, ignore, tuple(targets), kv)
    return QuantConfig(method, None, None, ignore, tuple(targets), kv, groups=tuple(by_group))


def _compressed_scheme(name: str, group: dict) -> QuantScheme:
    method = "compressed-tensors"
    weights, acts = group["weights"], group.get("input_activations")
    if weights.get("num_bits") != 8 or weights.get("type") != "float":
        raise _malformed(
            method,
            f"config group {name!r}: weights of {weights.get('num_bits')} bits, type "
            f"{weights.get('type')!r} (only 8-bit float)",
        )
    if weights.get("dynamic") or weights.get("symmetric", True) is not True:
        raise _malformed(method, f"config group {name!r}: weights must be static and symmetric")
    strategy = weights.get("strategy")
    if strategy == "block":
        block = _block_size(method, weights.get("block_structure"))
        weight, extra = FP8_BLOCK, {"block_size": block}
    elif strategy in ("tensor", "channel"):
        weight, extra = (FP8_TENSOR if strategy == "tensor" else FP8_CHANNEL), {}
    else:
        raise _malformed(method, f"config group {name!r}: weight strategy {strategy!r}")
    static_input = False
    if acts is not None:
        if acts.get("num_bits") != 8 or acts.get("type") != "float":
            raise _malformed(method, f"config group {name!r}: activations must be 8-bit float")
        if acts.get("dynamic") is False:
            if acts.get("strategy") != "tensor":
                raise _malformed(
                    method, f"config group {name!r}: static activations per tensor only"
                )
            static_input = True
        elif acts.get("strategy") not in ("token", "group", "tensor"):
            raise _malformed(
                method, f"config group {name!r}: activation strategy {acts.get('strategy')!r}"
            )
        if weight == FP8_BLOCK and static_input:
            raise _malformed(method, "block-wise weights need dynamic activations")
    return QuantScheme(weight, static_input_scale=static_input, **extra)


def _parse_modelopt(raw: dict) -> QuantConfig:
    method = "modelopt"
    inner = raw.get("quantization", raw)  # hf_quant_config.json nests it
    algo = inner.get("quant_algo")
    if algo != "FP8":
        raise _malformed(method, f"quant_algo {algo!r} (only 'FP8')")
    scheme = QuantScheme(FP8_TENSOR, static_input_scale=True)
    ignore = _names(method, inner, "exclude_modules") + _names(method, raw, "ignore")
    return QuantConfig(method, scheme, scheme, ignore)


def _parse_mxfp4(raw: dict) -> QuantConfig:
    # GPT-OSS: only the experts are MXFP4; attention, router, embeddings and head stay as stored.
    ignore = _names("mxfp4", raw, "modules_to_not_convert")
    return QuantConfig("mxfp4", None, QuantScheme(MXFP4, scale_name="scales"), ignore)


def _parse_gptq(raw: dict) -> QuantConfig:
    from atom_models.quantization.int_config import parse_gptq

    return parse_gptq(raw)


def _parse_awq(raw: dict) -> QuantConfig:
    from atom_models.quantization.int_config import parse_awq

    return parse_awq(raw)


_PARSERS = {
    "gptq": _parse_gptq,
    "awq": _parse_awq,
    "fp8": _parse_fp8,
    "compressed-tensors": _parse_compressed_tensors,
    "compressed_tensors": _parse_compressed_tensors,
    "modelopt": _parse_modelopt,
    "mxfp4": _parse_mxfp4,
    # vLLM renames GPT-OSS's "mxfp4" in the HF config it hands its models (in place, while it
    # resolves its config: GptOssForCausalLMConfig), so ATOM's models under vLLM read this name.
    "gpt_oss_mxfp4": _parse_mxfp4,
}
