"""Integer checkpoints' `quantization_config`: compressed-tensors int groups, GPTQ and AWQ.

Each is read into a `QuantScheme` of kind INT8 (W8A8) or WNA16 (4/8-bit weights packed in int32)
whose `checkpoint` names the tensor layout the loaders repack (`layers.int_checkpoint`).
"""

from __future__ import annotations

from atom_models.quantization.config import (
    INT8,
    WNA16,
    QuantConfig,
    QuantScheme,
    _malformed,
    _names,
)

CT_FORMATS = (
    None,
    "float-quantized",
    "naive-quantized",
    "int-quantized",
    "pack-quantized",
    "mixed-precision",  # each group names its own format
)
WNA16_BITS = (4, 8)


def _group_size(method: str, where: str, value) -> int:
    if value in (None, -1):
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _malformed(method, f"{where}: group_size must be a positive int or -1, got {value!r}")
    return value


def ct_int_scheme(name: str, group: dict, fmt: str | None) -> QuantScheme:
    """A compressed-tensors config group with int weights: W8A8 (int-quantized) or W4A16 /
    W8A16 (pack-quantized)."""
    method, where = "compressed-tensors", f"config group {name!r}"
    weights, acts = group["weights"], group.get("input_activations")
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if weights.get("dynamic"):
        raise _malformed(method, f"{where}: dynamic int weights")
    if acts is not None:  # W8A8
        if acts.get("type") != "int" or acts.get("num_bits") != 8:
            raise _malformed(
                method,
                f"{where}: int weights with {acts.get('num_bits')}-bit {acts.get('type')} "
                "activations (only int8 activations, or none)",
            )
        if acts.get("symmetric", True) is not True:
            raise _malformed(method, f"{where}: asymmetric int8 activations")
        if fmt not in ("int-quantized", "naive-quantized"):
            raise _malformed(method, f"{where}: W8A8 weights in format {fmt!r}")
        if bits != 8 or weights.get("symmetric", True) is not True:
            raise _malformed(method, f"{where}: W8A8 needs symmetric 8-bit weights")
        if strategy not in ("channel", "tensor"):
            raise _malformed(method, f"{where}: int8 weight strategy {strategy!r}")
        if acts.get("dynamic") is False:
            if acts.get("strategy") != "tensor":
                raise _malformed(method, f"{where}: static int8 activations per tensor only")
            static = True
        elif acts.get("strategy") == "token":
            static = False
        else:
            raise _malformed(method, f"{where}: dynamic int8 activations per token only")
        return QuantScheme(INT8, static_input_scale=static, channel_scale=strategy == "channel")
    if fmt != "pack-quantized":
        raise _malformed(method, f"{where}: weight-only int weights in format {fmt!r}")
    if bits not in WNA16_BITS:
        raise _malformed(method, f"{where}: {bits}-bit int weights (only {WNA16_BITS})")
    if strategy == "group":
        group_size = _group_size(method, where, weights.get("group_size"))
        if group_size == -1:
            raise _malformed(method, f"{where}: strategy 'group' needs a group_size")
    elif strategy == "channel":
        group_size = -1
    else:
        raise _malformed(method, f"{where}: int weight strategy {strategy!r}")
    actorder = weights.get("actorder")
    if actorder not in (None, "weight", "static", "group", "dynamic"):
        raise _malformed(method, f"{where}: actorder {actorder!r}")
    return QuantScheme(
        WNA16,
        checkpoint="ct",
        bits=bits,
        group_size=group_size,
        symmetric=weights.get("symmetric", True) is True,
        # "group" act-order stores each input feature's group (`weight_g_idx`); "weight" only
        # reorders the calibration and leaves the groups contiguous.
        g_idx=actorder in ("group", "dynamic") and strategy == "group",
    )


def parse_gptq(raw: dict) -> QuantConfig:
    method = "gptq"
    bits = raw.get("bits")
    if bits not in WNA16_BITS:
        raise _malformed(method, f"bits {bits!r} (only {WNA16_BITS})")
    fmt = raw.get("checkpoint_format", "gptq") or "gptq"
    if fmt not in ("gptq", "gptq_v2") or raw.get("is_marlin_format"):
        raise _malformed(method, f"checkpoint_format {fmt!r} (only 'gptq' and 'gptq_v2')")
    if raw.get("dynamic"):
        raise _malformed(method, "per-module `dynamic` overrides")
    if raw.get("lm_head"):
        raise _malformed(method, "a quantized lm_head")
    sym = raw.get("sym", True)
    scheme = QuantScheme(
        WNA16,
        checkpoint=fmt,
        bits=bits,
        group_size=_group_size(method, "config", raw.get("group_size", -1)),
        symmetric=sym is True,
        g_idx=bool(raw.get("desc_act", False)),
    )
    blocks = raw.get("modules_in_block_to_quantize") or []
    targets = tuple(
        name
        for block in blocks
        for name in (block if isinstance(block, (list, tuple)) else [block])
    )
    ignore = _names(method, raw, "modules_to_not_convert") + ("lm_head",)
    return QuantConfig(method, scheme, scheme, ignore, targets or ("Linear",))


def parse_awq(raw: dict) -> QuantConfig:
    method = "awq"
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise _malformed(method, f"version {raw.get('version')!r} (only 'gemm')")
    bits = raw.get("bits", raw.get("w_bit"))
    if bits != 4:
        raise _malformed(method, f"bits {bits!r} (only 4)")
    if raw.get("zero_point", True) is not True:
        raise _malformed(method, "zero_point false (only AWQ with zero points)")
    group_size = raw.get("group_size", raw.get("q_group_size", 128))
    scheme = QuantScheme(
        WNA16,
        checkpoint="awq",
        bits=4,
        group_size=_group_size(method, "config", group_size),
        symmetric=False,
    )
    ignore = _names(method, raw, "modules_to_not_convert") + ("lm_head",)
    return QuantConfig(method, scheme, scheme, ignore)
