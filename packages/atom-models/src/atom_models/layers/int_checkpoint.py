"""Integer checkpoints' tensors -> the one in-memory WNA16 layout (`atom_kernels.ops.int_quant`).

Each format stores a 4/8-bit weight, its scales, zero points and act-order groups its own way;
an adapter turns one checkpoint tensor into the canonical orientation, rows = output features:

    qweight  int32 [N, K * bits / 32]  packed along K, lowest bits first, unsigned
    scales   [N, G]                    (channel-wise: G = 1)
    zeros    int32 [N, G]              unpacked, unsigned (the float conversion comes later)
    g_idx    int32 [K]

after which the layer's loader cuts this rank's rows and columns as for any weight. Formats:

- "ct" (compressed-tensors pack-quantized): `weight_packed` [N, K * bits / 32] (already the
  canonical form: `pack_to_int32` packs along the last dim, lowest bits first, values offset by
  2**(bits-1)), `weight_scale` [N, G], `weight_zero_point` int32 [ceil(N * bits / 32), G] packed
  along N with the same offset, `weight_g_idx` [K], `weight_shape` [2].
- "gptq" / "gptq_v2": `qweight` [K * bits / 32, N] (packed along K: its transpose is canonical),
  `scales` [G, N], `qzeros` [G, N * bits / 32] packed along N, storing zero - 1 in "gptq" (v1) and
  the zero in "gptq_v2"; `g_idx` [K].
- "awq" (GEMM): `qweight` [K, N / 8] packed along N in the order 0, 2, 4, 6, 1, 3, 5, 7;
  `qzeros` [G, N / 8] likewise; `scales` [G, N].
"""

from __future__ import annotations

import torch

from atom_kernels.backends.torch.int_quant import unpack_int32  # the reference's unpacker

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column AWQ_ORDER[i]


def pack_int32(values: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Unsigned `bits`-bit values -> int32, 32 / bits consecutive values along `dim` a word,
    the lowest bits first (the length along `dim` must be a multiple of 32 / bits)."""
    per = 32 // bits
    v = values.movedim(dim, -1)
    if v.shape[-1] % per:
        raise ValueError(f"pack_int32: {v.shape[-1]} values are not a multiple of {per}")
    v = v.reshape(-1, v.shape[-1] // per, per)
    words = torch.empty(v.shape[:-1], dtype=torch.int32, device=v.device)
    shifts = torch.arange(per, device=v.device, dtype=torch.int64) * bits
    step = max(1, (1 << 24) // max(1, v.shape[1] * per))  # int64 temporaries of 128 MiB at most
    for start in range(0, v.shape[0], step):
        part = (v[start : start + step].to(torch.int64) << shifts).sum(-1)
        words[start : start + step] = torch.where(part >= 2**31, part - 2**32, part)
    shape = values.movedim(dim, -1).shape
    return words.reshape(*shape[:-1], shape[-1] // per).movedim(-1, dim)


def awq_unpack(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AWQ's words along the last dim -> values in column order."""
    values = unpack_int32(packed, bits)
    per = 32 // bits
    words = values.reshape(*values.shape[:-1], -1, per)
    order = torch.tensor(AWQ_ORDER[:per], device=values.device)
    out = torch.empty_like(words)
    out[..., order] = words
    return out.reshape(values.shape)


def awq_pack(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Values along the last dim -> AWQ's words (the inverse of `awq_unpack`)."""
    per = 32 // bits
    words = values.reshape(*values.shape[:-1], -1, per)
    order = torch.tensor(AWQ_ORDER[:per], device=values.device)
    return pack_int32(words[..., order].reshape(values.shape), bits)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def to_canonical(fmt: str, role: str, loaded: torch.Tensor, bits: int) -> torch.Tensor:
    """One checkpoint tensor of `fmt` in the role "qweight" | "scales" | "zeros" | "g_idx" ->
    the canonical orientation (module docstring); works on [..., rows, cols] (stacked experts)."""
    if role == "g_idx":
        return loaded.to(torch.int32)
    if fmt == "ct":
        if role == "zeros":
            return unpack_int32(loaded, bits, dim=-2)
        return loaded
    if fmt in ("gptq", "gptq_v2"):
        if role == "zeros":
            zeros = unpack_int32(loaded, bits)
            if fmt == "gptq":  # v1 stores zero - 1 (modulo 2**bits)
                zeros = (zeros + 1) & ((1 << bits) - 1)
            return _t(zeros)
        return _t(loaded)
    if fmt == "awq":
        if role == "qweight":
            return pack_int32(_t(awq_unpack(loaded, bits)), bits)
        if role == "zeros":
            return _t(awq_unpack(loaded, bits))
        return _t(loaded)
    raise ValueError(f"unknown integer checkpoint format {fmt!r}")


# The checkpoint's name of each role's tensor, per format.
TENSOR_NAMES = {
    "ct": {
        "qweight": "weight_packed",
        "scales": "weight_scale",
        "zeros": "weight_zero_point",
        "g_idx": "weight_g_idx",
        "shape": "weight_shape",
    },
    "gptq": {"qweight": "qweight", "scales": "scales", "zeros": "qzeros", "g_idx": "g_idx"},
    "awq": {"qweight": "qweight", "scales": "scales", "zeros": "qzeros"},
}
TENSOR_NAMES["gptq_v2"] = TENSOR_NAMES["gptq"]


def load_int_linear(layer, param, loaded: torch.Tensor, shard_id=None) -> None:
    """`LinearBase.weight_loader` for the parameters of an integer checkpoint (`param.int_role`,
    `param.int_format`, `param.bits`; `param.col_unit`: weight columns per parameter column, 0
    where every rank holds all columns, e.g. act-order groups)."""
    role, what = param.int_role, "weight" if shard_id is None else f"shard {shard_id}"
    dst, src, rows, full_rows = layer.row_plan(shard_id)
    col_src, cols, full_cols = layer.col_plan()
    if role == "shape":  # compressed-tensors' weight_shape: checked, not kept
        shape = tuple(int(v) for v in loaded.reshape(-1).tolist())
        if shape != (full_rows, full_cols):
            raise ValueError(f"{what}: weight_shape {shape}, expected {(full_rows, full_cols)}")
        return
    if param.int_format == "awq" and role == "qweight":
        # Cut this rank's part before AWQ's words are unpacked and repacked along K.
        per = 32 // param.bits
        if tuple(loaded.shape) == (full_cols, full_rows // per):
            if src % per == 0 and rows % per == 0:
                loaded, src, full_rows = loaded.narrow(1, src // per, rows // per), 0, rows
            if cols % per == 0:
                loaded, col_src, full_cols = loaded.narrow(0, col_src, cols), 0, cols
    t = to_canonical(param.int_format, role, loaded, param.bits)
    if role == "g_idx":
        if tuple(t.shape) != (full_cols,):
            raise ValueError(f"{what} g_idx: shape {tuple(t.shape)}, expected ({full_cols},)")
        mine = t.narrow(0, col_src, cols)
        if getattr(param, "g_idx_loaded", False):
            # One g_idx serves every shard of a fused layer (q/k/v, gate/up: GPTQ orders them
            # alike, from their shared input); shards ordered differently cannot be fused.
            if not torch.equal(param.data[:cols], mine.to(param.dtype)):
                raise ValueError(
                    f"{what} g_idx differs from the other shards' of this fused layer; ATOM "
                    "needs one act-order group order per fused layer"
                )
            return
        param.data.zero_()  # o_proj columns of dummy heads: group 0, zero weights
        param.data[:cols].copy_(mine)
        param.g_idx_loaded = True
        return
    if t.dim() != 2 or t.shape[0] != full_rows:
        raise ValueError(
            f"{what} {role}: checkpoint tensor has shape {tuple(loaded.shape)}, which holds "
            f"{tuple(t.shape)} in [N, ...]; expected {full_rows} rows"
        )
    unit = param.col_unit
    if unit:
        _, col_src, cols, full_cols = layer._in_units(
            (0, col_src, cols, full_cols), unit, param.shape[1], f"{what} {role} columns",
            layer.col_padding(),
        )  # fmt: skip
    else:
        col_src, cols, full_cols = 0, param.shape[1], param.shape[1]
    if t.shape[1] != full_cols:
        raise ValueError(
            f"{what} {role}: checkpoint tensor has shape {tuple(loaded.shape)}, which holds "
            f"{tuple(t.shape)} in [N, ...]; expected {(full_rows, full_cols)}"
        )
    mine = param.data.narrow(0, dst, rows + layer.row_padding(shard_id))
    mine.zero_()  # dummy heads' rows: zero scales make them project to zeros
    mine[:rows, :cols].copy_(t.narrow(0, src, rows).narrow(1, col_src, cols))
