"""Integer checkpoints (GPTQ, AWQ, compressed-tensors int-quantized / pack-quantized): config
parsing, and per-layer loading of tensors written as each format publishes them
(`atom_models.testing` packers), checked against the dequantized float layer; tensor-parallel
shards (ranks simulated in process) and expert-parallel experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from atom_models.distributed import tp_group
from atom_models.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from atom_models.loader import materialize
from atom_models.quantization import process_weights_after_loading, quantize_model
from atom_models.quantization.config import QuantScheme
from atom_models.quantization.methods import dequantize_linear, linear_method
from atom_models.testing import awq_pack, ct_int8, ct_pack_quantized, gptq_pack


class Rank:
    """One rank of a simulated tensor-parallel group (collectives are left to the test)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        raise NotImplementedError


WNA16_CASES = {
    # id: (packer, kwargs, scheme)
    "gptq-4b-g32": (gptq_pack, dict(bits=4, group_size=32), dict(checkpoint="gptq", bits=4,
                                                                  group_size=32)),
    "gptq-8b-channel-asym": (gptq_pack, dict(bits=8, group_size=-1, sym=False),
                             dict(checkpoint="gptq", bits=8, symmetric=False)),
    "gptq-4b-desc-act-asym": (gptq_pack, dict(bits=4, group_size=32, desc_act=True, sym=False),
                              dict(checkpoint="gptq", bits=4, group_size=32, symmetric=False,
                                   g_idx=True)),
    "gptq-v2-4b-asym": (gptq_pack, dict(bits=4, group_size=32, sym=False, v2=True),
                        dict(checkpoint="gptq_v2", bits=4, group_size=32, symmetric=False)),
    "awq-4b-g32": (awq_pack, dict(group_size=32), dict(checkpoint="awq", bits=4, group_size=32,
                                                       symmetric=False)),
    "ct-4b-g32": (ct_pack_quantized, dict(bits=4, group_size=32),
                  dict(checkpoint="ct", bits=4, group_size=32)),
    "ct-4b-g32-asym": (ct_pack_quantized, dict(bits=4, group_size=32, symmetric=False),
                       dict(checkpoint="ct", bits=4, group_size=32, symmetric=False)),
    "ct-8b-channel": (ct_pack_quantized, dict(bits=8, group_size=-1),
                      dict(checkpoint="ct", bits=8)),
    "ct-4b-actorder-asym": (ct_pack_quantized, dict(bits=4, group_size=32, symmetric=False,
                                                    actorder_group=True),
                            dict(checkpoint="ct", bits=4, group_size=32, symmetric=False,
                                 g_idx=True)),
}  # fmt: skip


def wna16(**kwargs) -> QuantScheme:
    return QuantScheme("wna16", **kwargs)


def build(make, scheme: QuantScheme, tp=None, dtype=torch.float32):
    """A linear layer made by `make()` on meta under `tp`, quantized by `scheme`, materialized."""
    with tp_group(tp or Rank(0, 1)), torch.device("meta"):
        layer = make()
    layer.params_dtype = dtype
    method = linear_method(scheme)
    method.create_weights(layer)
    layer.quant_method = method
    return materialize(layer, "cpu", dtype)


def load(layer, tensors: dict[str, torch.Tensor], shard_id=None) -> None:
    for suffix, tensor in tensors.items():
        param = getattr(layer, suffix)
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


def finish(layer) -> None:
    layer.quant_method.process_weights_after_loading(layer)


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) / k**0.5


def inputs(k: int, seed: int = 7) -> torch.Tensor:
    return torch.randn(5, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", list(WNA16_CASES))
def test_wna16_layer_computes_the_dequantized_weight(case):
    packer, kwargs, scheme_kwargs = WNA16_CASES[case]
    n, k = 48, 128
    tensors, deq = packer(weight(n, k, 0), **kwargs)
    layer = build(lambda: ReplicatedLinear(k, n, bias=False), wna16(**scheme_kwargs))
    load(layer, tensors)
    finish(layer)
    x = inputs(k)
    torch.testing.assert_close(layer(x), F.linear(x, deq), atol=1e-4, rtol=1e-4)
    # the weights stay packed: 32 / bits values an int32
    qweight = [p for p in layer.parameters() if p.dtype == torch.int32 and p.dim() == 2][0]
    assert qweight.shape == (n, k * scheme_kwargs["bits"] // 32)


def test_quantization_error_is_small_and_real():
    """The packers quantize for real: the dequantized weight is close to, not equal to, the float
    one, and a wrong zero convention (v1 read as v2) gives a different layer."""
    w = weight(32, 64, 1)
    tensors, deq = gptq_pack(w, bits=4, group_size=32, sym=False)
    assert 0 < (deq - w).abs().max() < 0.2 * w.abs().max()
    layer = build(
        lambda: ReplicatedLinear(64, 32, bias=False),
        wna16(checkpoint="gptq_v2", bits=4, group_size=32, symmetric=False),
    )
    load(layer, tensors)
    finish(layer)
    x = inputs(64)
    assert not torch.allclose(layer(x), F.linear(x, deq), atol=1e-3)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("static", [False, True])
def test_int8_layer_matches_the_dequantized_weight(per_channel, static):
    n, k = 40, 96
    x = inputs(k)
    input_scale = float(x.abs().max()) / 127 if static else None
    tensors, deq = ct_int8(weight(n, k, 2), per_channel=per_channel, input_scale=input_scale)
    scheme = QuantScheme("int8", static_input_scale=static, channel_scale=per_channel)
    layer = build(lambda: ReplicatedLinear(k, n, bias=True), scheme)
    load(layer, tensors)
    bias = torch.randn(n)
    layer.bias.weight_loader(layer.bias, bias)
    finish(layer)
    assert layer.weight.dtype == torch.int8 and layer.weight_scale.shape == (n,)
    # int8 activations: the error of quantizing x (per token, or per tensor) to 127 levels
    torch.testing.assert_close(layer(x), F.linear(x, deq, bias), atol=0.05, rtol=0.02)


def test_int8_per_tensor_scales_of_fused_shards_become_row_scales():
    k, sizes = 64, [24, 40]
    scheme = QuantScheme("int8", channel_scale=False)
    layer = build(lambda: MergedColumnParallelLinear(k, sizes), scheme)
    parts = []
    for shard, size in enumerate(sizes):
        tensors, deq = ct_int8(weight(size, k, 10 + shard) * (shard + 1), per_channel=False)
        load(layer, tensors, shard)
        parts.append(deq)
    finish(layer)
    assert torch.equal(layer.weight_scale[:24], layer.weight_scale[:1].expand(24))
    assert layer.weight_scale[0] != layer.weight_scale[-1]
    x = inputs(k)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat(parts)), atol=0.05, rtol=0.02)
