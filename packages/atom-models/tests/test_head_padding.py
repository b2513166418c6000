"""Attention heads padded with zero heads so that they split over the ranks (in process, ranks
simulated): the padded head counts, the padded shards of q/k/v and o_proj, and the ranks' partial
outputs adding up to the unpadded layer's. The gloo runs of whole padded models are in
test_tensor_parallel.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from atom_models.distributed import padded_attention_heads, tp_group
from atom_models.layers.linear import QKVParallelLinear, RowParallelLinear
from atom_models.loader import materialize
from atom_models.quantization import (
    parse_quant_config,
    process_weights_after_loading,
    quantize_model,
)
from atom_models.testing import fp8_block_quantize, fp8_channel_quantize, fp8_tensor_quantize
from atom_models.weights import load_weights

HIDDEN, D, T = 32, 8, 7  # hidden size, head size, tokens


class Rank:
    """One rank of a simulated tensor-parallel group that pads heads: collectives are left to
    the test."""

    pad_attention_heads = True

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise NotImplementedError


class Block(nn.Module):
    """q/k/v and o projections of one attention layer, loadable by the generic loader, around
    a plain causal attention (GQA)."""

    packed_modules_mapping = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"),
                              "v_proj": ("qkv_proj", "v")}  # fmt: skip

    def __init__(
        self, num_heads: int, num_kv_heads: int, tp: Rank, bias: bool, quant: str | None = None
    ) -> None:
        super().__init__()
        self.self_attn = nn.Module()
        with tp_group(tp), torch.device("meta"):
            qkv = QKVParallelLinear(HIDDEN, D, num_heads, num_kv_heads, bias=bias)
            self.self_attn.qkv_proj = qkv
            self.self_attn.o_proj = RowParallelLinear(
                num_heads * D, HIDDEN, bias=bias, input_padding=qkv.num_dummy_heads * D
            )
            quant_config = QUANT_CONFIGS[quant][0] if quant else None
            hf_config = SimpleNamespace(quantization_config=quant_config)
            quantize_model(self, parse_quant_config(hf_config), torch.float32)
        materialize(self, "cpu", torch.float32)
        with torch.no_grad():
            for p in self.parameters():  # poison: every element must be loaded or zeroed
                p.fill_(float("nan"))

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        load_weights(self, tensors.items())
        process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # T = tokens, H = this rank's heads, Hk = its KV heads, D = head size
        qkv = self.self_attn.qkv_proj
        q, k, v = (t.unflatten(-1, (-1, D)) for t in qkv.split(qkv(x)))  # [T, H|Hk, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [T, H, D]
        scores = torch.einsum("thd,shd->hts", q, k) * D**-0.5
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hts,shd->thd", probs, v)  # [T, H, D]
        return self.self_attn.o_proj(out.flatten(1))


def _compressed_tensors(strategy: str) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations}
    return {"quant_method": "compressed-tensors", "config_groups": {"g": group}}


def _scaled(quantize, scale_name: str):
    def scaled(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scale = quantize(w)
        return {name: q, name.replace(".weight", f".{scale_name}"): scale}

    return scaled


# FP8 checkpoints: (quantization_config, how a checkpoint weight is stored).
QUANT_CONFIGS = {
    # Rank 1's o_proj columns (6 heads x 8 = 48 of the checkpoint's 72) end in a partial block
    # of 16, filled up by zero columns.
    "fp8-block": (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [8, 16]},
        _scaled(lambda w: fp8_block_quantize(w, (8, 16)), "weight_scale_inv"),
    ),
    # One scale per q, k and v tensor, spread over their rows, dummy rows included.
    "fp8-tensor": (_compressed_tensors("tensor"), _scaled(fp8_tensor_quantize, "weight_scale")),
    "fp8-channel": (_compressed_tensors("channel"), _scaled(fp8_channel_quantize, "weight_scale")),
}


def checkpoint(
    num_heads: int, num_kv_heads: int, bias: bool, quant: str | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rows = {"q_proj": num_heads * D, "k_proj": num_kv_heads * D, "v_proj": num_kv_heads * D}
    shapes = {name: (n, HIDDEN) for name, n in rows.items()} | {"o_proj": (HIDDEN, num_heads * D)}
    out = {}
    for name, shape in shapes.items():
        weight = torch.randn(shape, generator=gen) / 4
        key = f"self_attn.{name}.weight"
        out |= QUANT_CONFIGS[quant][1](key, weight) if quant else {key: weight}
        if bias:
            out[f"self_attn.{name}.bias"] = torch.randn(shape[0], generator=gen)
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (float8 tensors have no torch.equal on CPU)."""
    if a.dtype.itemsize == 1:
        a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
    return torch.equal(a, b)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "padded"),
    [
        ((9, 3, 2, (12, 4))),  # SmolLM2 over 2 ranks: a dummy KV head with its 3 query heads
        ((9, 3, 3, (9, 3))),  # splits: unchanged
        ((9, 3, 4, (12, 4))),
        ((9, 3, 8, (24, 8))),  # 4 KV heads on 2 ranks each would split a group of 3
        ((9, 3, 6, (18, 6))),  # 3 KV heads on 2 ranks each would too
        ((8, 2, 4, (8, 2))),  # 2 KV heads, each replicated on 2 ranks: unchanged
        ((4, 1, 8, (8, 2))),  # 2 KV heads on 4 ranks each, 1 query head per rank
        ((3, 3, 2, (4, 4))),  # MHA
        ((3, 3, 8, (8, 8))),
        ((6, 3, 2, (8, 4))),
    ],
)  # fmt: skip
def test_padded_head_counts(heads, kv_heads, tp, padded):
    assert padded_attention_heads(heads, kv_heads, tp) == padded


def test_heads_not_a_multiple_of_kv_heads_are_refused():
    with pytest.raises(ValueError, match="8 attention heads are not a multiple of its 3 KV heads"):
        padded_attention_heads(8, 3, 4)


def test_a_group_that_does_not_pad_keeps_refusing():
    """Hosts that size their KV cache themselves (vLLM, SGLang) do not set pad_attention_heads."""

    class Plain(Rank):
        pad_attention_heads = False

    with pytest.raises(ValueError, match="number of attention heads 9 is not divisible by .* 2"):
        Block(9, 3, Plain(0, 2), bias=False)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tp", "bias", "quant"),
    [
        (9, 3, 2, True, None),
        (3, 3, 2, False, None),
        (9, 3, 4, False, None),
        (4, 1, 8, True, None),
        (9, 3, 2, True, "fp8-block"),
        (9, 3, 2, False, "fp8-tensor"),
        (9, 3, 2, True, "fp8-channel"),
    ],
    ids=["gqa-9-3-tp2-bias", "mha-3-tp2", "gqa-9-3-tp4", "mqa-4-1-tp8-bias",
         "gqa-9-3-tp2-fp8-block", "gqa-9-3-tp2-fp8-tensor", "gqa-9-3-tp2-fp8-channel"],
)  # fmt: skip
def test_padded_ranks_sum_to_the_full_layer(heads, kv_heads, tp, bias, quant):
    """Each rank holds the checkpoint's heads that fall in its part of the padded layout, then
    zeros (q/k/v rows, biases, o_proj columns; scales too): the ranks' partial outputs add up to
    the unsharded layer's."""
    tensors = checkpoint(heads, kv_heads, bias, quant)
    full = Block(heads, kv_heads, Rank(0, 1), bias, quant)
    full.load(tensors)
    x = torch.randn(T, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = full(x)
    padded, padded_kv = padded_attention_heads(heads, kv_heads, tp)
    total = torch.zeros_like(expected)
    for rank in range(tp):
        block = Block(heads, kv_heads, Rank(rank, tp), bias, quant)
        block.load(tensors)
        qkv, o_proj = block.self_attn.qkv_proj, block.self_attn.o_proj
        assert (qkv.num_dummy_heads, qkv.num_dummy_kv_heads) == (
            padded - heads,
            padded_kv - kv_heads,
        )
        assert qkv.num_heads == padded // tp and o_proj.input_size == padded // tp * D
        q_rows = qkv.num_heads * D
        q_start = rank * q_rows  # in the padded layout; the checkpoint's rows come first
        real = max(0, min(q_rows, heads * D - q_start))
        q = qkv.weight[:q_rows]
        assert same(q[:real], tensors["self_attn.q_proj.weight"][q_start : q_start + real])
        assert not q[real:].float().any()
        o = o_proj.weight
        assert same(o[:, :real], tensors["self_attn.o_proj.weight"][:, q_start:][:, :real])
        assert not o[:, real:].float().any()
        for p in block.parameters():
            assert not p.float().isnan().any()
        if quant == "fp8-tensor":  # a shard's scale on all its rows, its dummy heads' too
            sizes = dict(q=q_rows, k=qkv.num_kv_heads * D, v=qkv.num_kv_heads * D)
            scales = [
                tensors[f"self_attn.{n}_proj.weight_scale"].expand(m) for n, m in sizes.items()
            ]
            assert torch.equal(qkv.weight_scale, torch.cat(scales))
        total += block(x)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)
