"""Tiny random checkpoints saved by `transformers` itself, for tests without downloads.

Used by ATOM's own tests and by hosts' integration tests (vLLM, SGLang) to build checkpoints in
the exact layout Hugging Face publishes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations.

    HF's 0.02-std init makes every logit nearly zero, which would let real bugs hide under an
    absolute tolerance and turn greedy decoding into a coin toss between near-tied tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        # Float buffers saved with the weights (GLM-4-MoE's e_score_correction_bias).
        saved = model.state_dict().keys()
        for name, b in model.named_buffers():
            if name in saved and b.is_floating_point():
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def save_random_checkpoint(
    config, path: str | Path, seed: int = 0, tokenizer=None, max_shard_size: str | None = None
):
    """Save a randomly initialized `transformers` model of `config` (float32) to `path`
    (in shards of at most `max_shard_size`, e.g. "20KB", when given).

    Returns the transformers model (eval mode) for use as the reference. With `tokenizer`, its
    files are saved beside the weights so engines can load the directory as a whole checkpoint.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
        ).save_pretrained(path)
    return model.eval()


def add_random_mtp_layers(path: str | Path, num_layers: int = 1, seed: int = 0):
    """Append `num_layers` random multi-token-prediction layers to the single-file checkpoint at
    `path` (transformers saves none) and set `num_nextn_predict_layers` in its config.json.

    Each is laid out as DeepSeek-V3 / GLM-4.5 publish it, `model.layers.{num_hidden_layers + i}.`:
    a decoder block shaped like the last decoder layer of its kind (MoE from index
    `first_k_dense_replace` on, dense before), `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`,
    `shared_head.head`, and a copy of the embedding. Returns the added tensors.
    """
    import json

    from safetensors.torch import load_file, save_file

    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)

    def rand(name: str, shape) -> torch.Tensor:  # as randomize_ draws them
        x = torch.randn(shape, generator=gen)
        if "norm" in name:
            return 1.0 + 0.2 * x
        return 0.1 * x if len(shape) == 1 else x / shape[-1] ** 0.5

    first_moe = config.get("first_k_dense_replace", 0)
    added = {}
    for idx in range(n, n + num_layers):
        kind = [j for j in range(n) if (j >= first_moe) == (idx >= first_moe)]
        if not kind:
            raise ValueError(f"no decoder layer is shaped like MTP layer {idx} (dense or MoE)")
        last, prefix = f"model.layers.{kind[-1]}.", f"model.layers.{idx}."
        for name, t in tensors.items():
            if name.startswith(last):
                added[prefix + name[len(last) :]] = rand(name, t.shape)
        for leaf, shape in [
            ("enorm.weight", (hidden,)),
            ("hnorm.weight", (hidden,)),
            ("eh_proj.weight", (hidden, 2 * hidden)),
            ("shared_head.norm.weight", (hidden,)),
            ("shared_head.head.weight", (config["vocab_size"], hidden)),
        ]:
            added[prefix + leaf] = rand(leaf, shape)
        added[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file({**tensors, **added}, file, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return added


def transformers_gguf_model(path: str | Path):
    """transformers' own float32 load of a GGUF file (eval mode): the reference for GGUF tests."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    # from_pretrained(gguf_file=...) refuses to run without `accelerate`, which nothing in ATOM
    # needs; for llama it loads the weights with this same function
    # (GgufHfQuantizer.get_state_dict -> load_gguf_checkpoint).
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()


# -- quantized checkpoints, written by the tests from an unquantized one ------------------------

FP8_MAX = 448.0
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def fp8_block_quantize(w: torch.Tensor, block: tuple[int, int]):
    """w [N, K] -> (float8_e4m3fn [N, K], fp32 scale_inv [ceil(N/bn), ceil(K/bk)]) with
    w ~= q * scale_inv per block (partial edge blocks included)."""
    bn, bk = block
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = w.float()
    blocks = padded.view(gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale.float()


def fp8_channel_quantize(w: torch.Tensor):
    """w [N, K] -> (float8_e4m3fn [N, K], fp32 scale [N, 1]) (compressed-tensors' layout)."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_tensor_quantize(w: torch.Tensor):
    """w -> (float8_e4m3fn, fp32 scale of shape [1])."""
    scale = (w.float().abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(1)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def mxfp4_quantize(w: torch.Tensor):
    """w [..., K] (K a multiple of 32) -> (uint8 blocks [..., K/32, 16], uint8 e8m0 scales
    [..., K/32]): each group of 32 scaled by a power of two so its largest value fits e2m1's 6,
    rounded to the nearest e2m1 value, two values a byte (low nibble first)."""
    groups = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = groups.abs().amax(dim=-1).clamp(min=2.0**-126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exp)[..., None]
    grid = torch.tensor(_E2M1)
    index = (scaled.abs()[..., None] - grid).abs().argmin(dim=-1)
    codes = index + 8 * (scaled < 0).long()
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exp + 127).to(torch.uint8)


def write_quantized_checkpoint(
    src: str | Path,
    dst: str | Path,
    quantization_config: dict,
    quantize,
    select=lambda name, tensor: name.endswith("_proj.weight") and tensor.dim() == 2,
) -> Path:
    """Copy the checkpoint `src` to `dst` with `quantize(name, tensor) -> {name: tensor}` applied
    to the tensors `select(name, tensor)` picks, and `quantization_config` in config.json."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in (
            "config.json",
            "model.safetensors.index.json",
        ):
            shutil.copy(f, dst / f.name)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(f).items():
            out.update(quantize(name, tensor) if select(name, tensor) else {name: tensor})
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


# -- integer checkpoints ---------------------------------------------------------------------
#
# Each packer quantizes a float weight [N, K] (an nn.Linear's, out x in) and returns the
# checkpoint tensors of one module as its format publishes them, by checkpoint suffix, and the
# float32 weight they dequantize to. They are written from the formats' own packing code
# (AutoGPTQ's `pack`, AutoAWQ's GEMM `pack`, compressed-tensors' `pack_to_int32`), word by word,
# independently of ATOM's loaders.


def _groups_of(k: int, group_size: int, act_order: bool, seed: int) -> torch.Tensor:
    """The group of each input feature: contiguous, or GPTQ act-order's (groups of a random
    permutation of the features)."""
    size = k if group_size == -1 else group_size
    if not act_order:
        return torch.arange(k) // size
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // size
    return g_idx


def _quantize_int(w, bits, group_size, symmetric, g_idx, scale_dtype):
    """-> unsigned values q [N, K], scales [N, G] (rounded to scale_dtype), zeros [N, G] and
    the dequantized weight (q - zero) * scale in float32."""
    w = w.float()
    n, k = w.shape
    num_groups = int(g_idx.max()) + 1
    top = (1 << bits) - 1
    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups, dtype=torch.int64)
    for g in range(num_groups):
        cols = w[:, g_idx == g]
        if symmetric:
            scales[:, g] = cols.abs().amax(1).clamp(min=1e-6) / ((1 << (bits - 1)) - 1)
            zeros[:, g] = 1 << (bits - 1)
        else:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            scales[:, g] = ((hi - lo) / top).clamp(min=1e-6)
            zeros[:, g] = torch.round(-lo / scales[:, g]).clamp(0, top).long()
    scales = scales.to(scale_dtype).float()
    s, z = scales[:, g_idx], zeros[:, g_idx]
    q = (torch.round(w / s) + z).clamp(0, top).long()
    return q, scales.to(scale_dtype), zeros, ((q - z) * s).float()


def _words(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """Pack the last dim of unsigned `values`, value order[i] of each word at bits i * bits
    (lowest first), into int32 words."""
    per = 32 // bits
    order = order or list(range(per))
    v = values.long().reshape(*values.shape[:-1], -1, per)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for i in range(per):
        word |= (v[..., order[i]] & ((1 << bits) - 1)) << (bits * i)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def gptq_pack(
    w: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    sym: bool = True,
    desc_act: bool = False,
    v2: bool = False,
    seed: int = 0,
):
    """GPTQ: qweight int32 [K * bits / 32, N] (packed along K), qzeros int32 [G, N * bits / 32]
    (packed along N; v1 stores zero - 1), scales fp16 [G, N], g_idx int32 [K]."""
    k = w.shape[1]
    g_idx = _groups_of(k, group_size, desc_act, seed)
    q, scales, zeros, deq = _quantize_int(w, bits, group_size, bool(sym), g_idx, torch.float16)
    stored = zeros if v2 else (zeros - 1) & ((1 << bits) - 1)
    tensors = {
        "qweight": _words(q, bits).t().contiguous(),
        "qzeros": _words(stored.t(), bits),
        "scales": scales.t().contiguous(),
        "g_idx": g_idx.to(torch.int32),
    }
    return tensors, deq


def awq_pack(w: torch.Tensor, group_size: int = 128, *, seed: int = 0):
    """AWQ GEMM (4-bit, zero points): qweight int32 [K, N / 8] packed along N in the order
    0, 2, 4, 6, 1, 3, 5, 7; qzeros int32 [G, N / 8] likewise; scales fp16 [G, N]."""
    g_idx = _groups_of(w.shape[1], group_size, False, seed)
    q, scales, zeros, deq = _quantize_int(w, 4, group_size, False, g_idx, torch.float16)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    tensors = {
        "qweight": _words(q.t(), 4, order),
        "qzeros": _words(zeros.t(), 4, order),
        "scales": scales.t().contiguous(),
    }
    return tensors, deq


def ct_pack_quantized(
    w: torch.Tensor,
    bits: int = 4,
    group_size: int = 128,
    *,
    symmetric: bool = True,
    actorder_group: bool = False,
    scale_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
):
    """compressed-tensors pack-quantized: weight_packed int32 [N, K * bits / 32] (signed values
    offset by 2**(bits - 1), packed along K), weight_scale [N, G] (G = 1: strategy "channel"),
    weight_zero_point (asymmetric) int32 [N * bits / 32, G] packed along N the same way,
    weight_shape [2], weight_g_idx [K] (actorder "group")."""
    n, k = w.shape
    g_idx = _groups_of(k, group_size, actorder_group, seed)
    q, scales, zeros, deq = _quantize_int(w, bits, group_size, symmetric, g_idx, scale_dtype)
    # compressed-tensors quantizes to signed values q - 2**(bits-1) with a signed zero point
    # zp - 2**(bits-1); pack_to_int32 adds 2**(bits-1) back before packing: the same words.
    tensors = {
        "weight_packed": _words(q, bits),
        "weight_scale": scales,
        "weight_shape": torch.tensor([n, k]),
    }
    if not symmetric:
        tensors["weight_zero_point"] = _words(zeros.t(), bits).t().contiguous()
    if actorder_group:
        tensors["weight_g_idx"] = g_idx.to(torch.int32)
    return tensors, deq


def ct_int8(w: torch.Tensor, *, per_channel: bool = True, input_scale: float | None = None):
    """compressed-tensors int-quantized (W8A8): weight int8 [N, K], weight_scale float32 [N, 1]
    (or [1] per tensor), input_scale [1] when static."""
    w = w.float()
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax().reshape(1)
    scale = amax.clamp(min=1e-6) / 127
    q = torch.round(w / (scale if per_channel else scale[0])).clamp(-127, 127).to(torch.int8)
    tensors = {"weight": q, "weight_scale": scale}
    if input_scale is not None:
        tensors["input_scale"] = torch.tensor([input_scale])
    deq = q.float() * (scale if per_channel else scale[0])
    return tensors, deq
