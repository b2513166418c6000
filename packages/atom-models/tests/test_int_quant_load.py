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
from atom_models.quantization import process_weights_after_loading
from atom_models.quantization.config import QuantScheme
from atom_models.quantization.methods import dequantize_linear, linear_method, moe_method
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


# -- tensor parallelism (ranks simulated in process) ----------------------------------------

TP_CASES = ["gptq-4b-g32", "gptq-4b-desc-act-asym", "awq-4b-g32", "ct-4b-g32-asym",
            "ct-8b-channel", "gptq-8b-channel-asym"]  # fmt: skip


@pytest.mark.parametrize("case", TP_CASES)
def test_column_parallel_ranks_hold_their_rows(case):
    packer, kwargs, scheme_kwargs = WNA16_CASES[case]
    n, k = 64, 128
    tensors, deq = packer(weight(n, k, 3), **kwargs)
    x = inputs(k)
    outs = []
    for rank in range(2):
        layer = build(lambda: ColumnParallelLinear(k, n), wna16(**scheme_kwargs), Rank(rank, 2))
        load(layer, tensors)
        finish(layer)
        outs.append(layer(x))
    torch.testing.assert_close(torch.cat(outs, -1), F.linear(x, deq), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", TP_CASES)
def test_row_parallel_ranks_sum_to_the_full_layer(case):
    """Each rank holds half the input features; with act-order (g_idx) every rank keeps all
    groups' scales and zeros, since its features may fall in any group."""
    packer, kwargs, scheme_kwargs = WNA16_CASES[case]
    n, k = 48, 128
    tensors, deq = packer(weight(n, k, 4), **kwargs)
    x = inputs(k)
    bias = torch.randn(n)
    total = 0
    for rank in range(2):
        layer = build(lambda: RowParallelLinear(k, n, bias=True), wna16(**scheme_kwargs),
                      Rank(rank, 2))  # fmt: skip
        load(layer, tensors)
        layer.bias.weight_loader(layer.bias, bias)
        finish(layer)
        names = {name for name, _ in layer.named_parameters()}
        if scheme_kwargs.get("g_idx"):
            g_idx = layer.g_idx if "g_idx" in names else layer.weight_g_idx
            full_idx = tensors.get("g_idx", tensors.get("weight_g_idx"))
            assert torch.equal(g_idx, full_idx[rank * k // 2 : (rank + 1) * k // 2])
        total = total + layer(x[:, rank * k // 2 : (rank + 1) * k // 2])
    torch.testing.assert_close(total, F.linear(x, deq, bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["gptq-4b-desc-act-asym", "awq-4b-g32", "ct-4b-g32-asym"])
def test_fused_qkv_and_gate_up_shards(case):
    """q/k/v and gate/up are separate checkpoint modules (own scales, zero points, g_idx) loaded
    into one packed layer, per rank."""
    packer, kwargs, scheme_kwargs = WNA16_CASES[case]
    hidden, head, heads, kv_heads = 64, 16, 4, 2
    x = inputs(hidden)
    sizes = {"q": heads * head, "k": kv_heads * head, "v": kv_heads * head}
    ckpt = {
        s: packer(weight(n, hidden, 20 + i), **kwargs) for i, (s, n) in enumerate(sizes.items())
    }
    gate_up = [packer(weight(96, hidden, 30 + i), **kwargs) for i in range(2)]
    for tp_size in (1, 2):
        qkv_out, mlp_out = [], []
        for rank in range(tp_size):
            tp = Rank(rank, tp_size)
            qkv = build(lambda: QKVParallelLinear(hidden, head, heads, kv_heads),
                        wna16(**scheme_kwargs), tp)  # fmt: skip
            for s, (tensors, _) in ckpt.items():
                load(qkv, tensors, s)
            finish(qkv)
            qkv_out.append(qkv.split(qkv(x)))
            mlp = build(lambda: MergedColumnParallelLinear(hidden, [96, 96]),
                        wna16(**scheme_kwargs), tp)  # fmt: skip
            for i, (tensors, _) in enumerate(gate_up):
                load(mlp, tensors, i)
            finish(mlp)
            mlp_out.append(mlp(x).chunk(2, -1))
        for j, s in enumerate("qkv"):
            got = torch.cat([out[j] for out in qkv_out], -1)
            torch.testing.assert_close(got, F.linear(x, ckpt[s][1]), atol=1e-4, rtol=1e-4)
        for j in range(2):
            got = torch.cat([out[j] for out in mlp_out], -1)
            torch.testing.assert_close(got, F.linear(x, gate_up[j][1]), atol=1e-4, rtol=1e-4)


def test_fused_shards_with_different_act_order_are_an_error():
    scheme = wna16(checkpoint="gptq", bits=4, group_size=32, g_idx=True)
    layer = build(lambda: MergedColumnParallelLinear(64, [32, 32]), scheme)
    load(layer, gptq_pack(weight(32, 64, 8), group_size=32, desc_act=True, seed=1)[0], 0)
    with pytest.raises(ValueError, match="g_idx differs from the other shards"):
        load(layer, gptq_pack(weight(32, 64, 9), group_size=32, desc_act=True, seed=2)[0], 1)


def test_row_parallel_split_off_the_groups_is_an_error():
    """Without act-order, a rank's input features must be whole groups."""
    tensors, _ = gptq_pack(weight(32, 192, 5), bits=4, group_size=64)
    layer = build(lambda: RowParallelLinear(192, 32), wna16(checkpoint="gptq", bits=4,
                                                           group_size=64), Rank(1, 2))  # fmt: skip
    with pytest.raises(ValueError, match="quantization blocks of 64"):
        load(layer, tensors)


def test_dequantize_linear_gives_the_float_weight():
    """MLA's kv_b_proj (and any host reading the weight) gets the dequantized weight."""
    tensors, deq = gptq_pack(weight(48, 64, 6), bits=4, group_size=32, sym=False)
    layer = build(lambda: ReplicatedLinear(64, 48, bias=False),
                  wna16(checkpoint="gptq", bits=4, group_size=32, symmetric=False))  # fmt: skip
    load(layer, tensors)
    finish(layer)
    dequantize_linear(layer, torch.float32)
    assert [name for name, _ in layer.named_parameters()] == ["weight"]
    torch.testing.assert_close(layer.weight.data, deq, atol=1e-6, rtol=1e-6)
    x = inputs(64)
    torch.testing.assert_close(layer(x), F.linear(x, deq), atol=1e-5, rtol=1e-5)


# -- experts --------------------------------------------------------------------------------

E, H, M = 4, 64, 64  # experts, hidden size, expert intermediate size

MOE_CASES = ["gptq-4b-g32", "gptq-v2-4b-asym", "awq-4b-g32", "ct-4b-g32-asym", "ct-8b-channel"]


class Block(nn.Module):
    """The smallest model holding a FusedMoE at `mlp.experts`, loadable by the generic loader."""

    def __init__(self, scheme: QuantScheme, tp=None, **kwargs) -> None:
        super().__init__()
        from atom_models.layers.moe import FusedMoE, fused_moe_mapping

        with tp_group(tp or Rank(0, 1)), torch.device("meta"):
            self.mlp = nn.Module()
            self.mlp.experts = FusedMoE(E, H, M, **kwargs)
        self.packed_modules_mapping = fused_moe_mapping(E)
        experts = self.mlp.experts
        experts.params_dtype = torch.float32
        method = moe_method(scheme)
        method.create_weights(experts)
        experts.quant_method = method
        materialize(self, "cpu", torch.float32)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        from atom_models.weights import load_weights

        load_weights(self, tensors.items())  # strict: every parameter filled, nothing left
        process_weights_after_loading(self)


def expert_checkpoint(case: str, seed: int = 0):
    """Per-expert tensors of `case`'s format, and each expert's dequantized (gate, up, down)."""
    packer, kwargs, _ = WNA16_CASES[case]
    tensors, deq = {}, []
    for e in range(E):
        mats = []
        for j, (name, shape) in enumerate(
            (("gate_proj", (M, H)), ("up_proj", (M, H)), ("down_proj", (H, M)))
        ):
            packed, w = packer(weight(*shape, seed * 100 + e * 3 + j), **kwargs)
            tensors.update({f"mlp.experts.{e}.{name}.{s}": t for s, t in packed.items()})
            mats.append(w)
        deq.append(mats)
    return tensors, deq


def routing(seed: int = 1, tokens: int = 9, top_k: int = 2):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    weights = torch.rand(tokens, top_k, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)])
    return x, weights, ids


def reference_experts(deq, x, weights, ids) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t], ids[t].tolist(), strict=True):
            gate, up, down = deq[e]
            out[t] += w * F.linear(F.silu(F.linear(x[t], gate)) * F.linear(x[t], up), down)
    return out


@pytest.mark.parametrize("case", MOE_CASES)
def test_wna16_experts_compute_the_dequantized_experts(case):
    scheme = wna16(**WNA16_CASES[case][2])
    tensors, deq = expert_checkpoint(case)
    block = Block(scheme)
    block.load(tensors)
    x, weights, ids = routing()
    expected = reference_experts(deq, x, weights, ids)
    torch.testing.assert_close(block.mlp.experts(x, weights, ids), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("case", ["gptq-4b-g32", "ct-4b-g32-asym", "ct-8b-channel"])
def test_wna16_experts_tensor_and_expert_parallel(case):
    """TP=2 splits every expert's intermediate dim (partial sums add up); EP=2 gives each rank
    half the experts, loading only those (the others' tensors are skipped, strict loading)."""
    scheme = wna16(**WNA16_CASES[case][2])
    tensors, deq = expert_checkpoint(case, seed=1)
    x, weights, ids = routing(seed=2)
    expected = reference_experts(deq, x, weights, ids)
    for kwargs in ({"tp": Rank(0, 2)}, {"ep_size": 2}):
        total = 0
        for rank in range(2):
            if "tp" in kwargs:
                block = Block(scheme, tp=Rank(rank, 2))
            else:
                block = Block(scheme, ep_rank=rank, ep_size=2)
            block.load(tensors)
            total = total + block.mlp.experts(x, weights, ids)
        torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)


def test_act_order_experts_are_rejected():
    with pytest.raises(ValueError, match="act-order groups .* experts are not supported"):
        Block(wna16(checkpoint="gptq", bits=4, group_size=32, g_idx=True))
    # desc_act off in the config but a permuted g_idx in the checkpoint: caught at load
    tensors, _ = expert_checkpoint("gptq-4b-g32")
    tensors["mlp.experts.1.up_proj.g_idx"] = tensors["mlp.experts.1.up_proj.g_idx"].flip(0)
    with pytest.raises(ValueError, match="g_idx is not contiguous"):
        Block(wna16(checkpoint="gptq", bits=4, group_size=32)).load(tensors)


# -- random weights (load_format="dummy") --------------------------------------------------


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True},
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
    ],
    ids=["gptq-desc-act", "awq"],
)
def test_dummy_weights_are_sane_packed_weights(quant, tmp_path, paged_session):
    """`--load-format dummy` builds a W4A16 model from its config alone: random packed words,
    scales giving weights of std ~0.02, finite logits."""
    from transformers import LlamaConfig

    from atom_models import load_model
    from atom_models.quantization.methods import dequantize_linear

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         architectures=["LlamaForCausalLM"])  # fmt: skip
    config.quantization_config = quant
    config.save_pretrained(tmp_path)
    model = load_model(tmp_path, load_format="dummy")
    down = model.model.layers[0].mlp.down_proj
    assert down.qweight.dtype == torch.int32 and down.qweight.shape == (64, 128 // 8)
    assert (down.qweight != 0).float().mean() > 0.9
    logits = paged_session(model).step({0: [1, 2, 3, 4, 5]})[0]
    assert torch.isfinite(logits).all() and logits.std() > 0
    dequantize_linear(down, torch.float32)
    assert 0.01 < down.weight.std() < 0.04


# -- whole models against transformers ----------------------------------------------------


def _quantized_and_reference(src, dst, ref, quant_config, packer, **kwargs):
    """`src` with every 2-D `*_proj.weight` packed by `packer` (-> `dst`), and the same model
    with those weights dequantized, stored in float (-> `ref`, for transformers)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from atom_models.testing import write_quantized_checkpoint

    deq = {}

    def quantize(name, tensor):
        tensors, deq[name] = packer(tensor, **kwargs)
        return {f"{name[: -len('weight')]}{s}": t for s, t in tensors.items()}

    def select(name, tensor):
        return name.endswith("_proj.weight") and tensor.dim() == 2 and "mlp.gate." not in name

    write_quantized_checkpoint(src, dst, quant_config, quantize, select)
    shutil.copytree(src, ref)
    (f,) = ref.glob("*.safetensors")
    save_file({n: deq.get(n, t) for n, t in load_file(f).items()}, f, metadata={"format": "pt"})


@pytest.mark.parametrize("fmt", ["gptq-asym", "ct-w4a16-asym"])
def test_qwen3_moe_matches_transformers_on_the_dequantized_model(
    fmt, make_checkpoint, paged_session, tmp_path
):
    """Attention, and every routed expert (per-expert checkpoint tensors into FusedMoE), from
    an integer checkpoint: ATOM's logits equal transformers' on the dequantized weights."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from atom_models import load_model

    config = Qwen3MoeConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                            moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)  # fmt: skip
    src, _ = make_checkpoint(config)
    if fmt == "gptq-asym":
        quant = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False}
        packer, kwargs = gptq_pack, dict(bits=4, group_size=32, sym=False)
    else:
        weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32,
                   "symmetric": False}  # fmt: skip
        quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                 "config_groups": {"g": {"targets": ["Linear"], "weights": weights}},
                 "ignore": ["lm_head", "re:.*mlp.gate$"]}  # fmt: skip
        packer, kwargs = ct_pack_quantized, dict(bits=4, group_size=32, symmetric=False,
                                                 scale_dtype=torch.float32)  # fmt: skip
    dst, ref = tmp_path / "q", tmp_path / "ref"
    _quantized_and_reference(src, dst, ref, quant, packer, **kwargs)
    model = load_model(dst)
    experts = model.model.layers[0].mlp.experts
    assert experts.quant_method.kernel_args(experts)["quant"] == "wna16"
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32).eval()
    tokens = torch.randint(0, 97, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    got = paged_session(model).step({0: tokens})[0]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


# -- on the GPU (the Triton kernels), run by the lead -------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gptq-4b-desc-act-asym", "awq-4b-g32", "ct-8b-channel"])
def test_wna16_layer_and_experts_on_the_gpu(case):
    """The loaded layouts through the GPU kernels, in bf16: a linear layer at decode and prefill
    sizes, and the experts (act-order is linear-only)."""
    packer, kwargs, scheme_kwargs = WNA16_CASES[case]
    n, k = 256, 512
    tensors, deq = packer(weight(n, k, 0), **kwargs)
    with tp_group(Rank(0, 1)), torch.device("meta"):
        layer = RowParallelLinear(k, n, bias=False)
    layer.params_dtype = torch.bfloat16
    layer.quant_method = linear_method(wna16(**scheme_kwargs))
    layer.quant_method.create_weights(layer)
    materialize(layer, "cuda", torch.bfloat16)
    load(layer, {s: t.cuda() for s, t in tensors.items()})
    finish(layer)
    for rows in (1, 3, 200):
        x = inputs(k, seed=rows).repeat(rows // 5 + 1, 1)[:rows].cuda().bfloat16()
        expected = F.linear(x.float(), deq.cuda().bfloat16().float())
        torch.testing.assert_close(layer(x).float(), expected, atol=3e-2, rtol=2e-2)
    if scheme_kwargs.get("g_idx"):
        return
    scheme = wna16(**scheme_kwargs)
    tensors, deq = expert_checkpoint(case)
    block = Block(scheme)
    block.load(tensors)
    x, weights, ids = routing()
    expected = reference_experts(deq, x, weights, ids)
    experts = block.mlp.experts.cuda().to(torch.bfloat16)
    got = experts(x.cuda().bfloat16(), weights.cuda(), ids.cuda())
    torch.testing.assert_close(got.float().cpu(), expected, atol=3e-2, rtol=3e-2)


# -- the fragment layout (atom_kernels.ops.int_quant_frag) ---------------------------------


def _frag_layer(device, dtype, symmetric, monkeypatch, preferred=None):
    """A 4-bit group-128 compressed-tensors RowParallelLinear loaded and finished with the
    fragment layout asked for (``preferred``: frag_preferred's answer forced, e.g. on the CPU);
    (layer, dequantized weight)."""
    from atom_kernels import envs

    monkeypatch.setattr(envs, "ATOM_WNA16_FRAG", True)
    if preferred is not None:
        from atom_models.quantization import int_methods

        monkeypatch.setattr(int_methods, "frag_preferred", lambda *_: preferred)
    n, k = 64, 512
    tensors, deq = ct_pack_quantized(weight(n, k, 3), bits=4, group_size=128,
                                     symmetric=symmetric)  # fmt: skip
    with tp_group(Rank(0, 1)), torch.device("meta"):
        layer = RowParallelLinear(k, n, bias=False)
    layer.params_dtype = dtype
    layer.quant_method = linear_method(wna16(checkpoint="ct", bits=4, group_size=128,
                                             symmetric=symmetric))  # fmt: skip
    layer.quant_method.create_weights(layer)
    materialize(layer, device, dtype)
    load(layer, {s: t.to(device) for s, t in tensors.items()})
    finish(layer)
    return layer, deq


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_wna16_layer_repacked_into_the_fragment_layout(symmetric, monkeypatch):
    """Where the kernels prefer it, a fitting 4-bit layer holds its words, scales (and zeros) in
    the fragment layout after loading, and computes the dequantized checkpoint's product (the
    torch backend undoing the layout here; the GPU kernels in the test below)."""
    layer, deq = _frag_layer("cpu", torch.float32, symmetric, monkeypatch, preferred=True)
    method = layer.quant_method
    qweight, scales, zeros, _ = method._tensors(layer)
    assert qweight.shape == (4, 8, 32, 4) and scales.shape == (4, 4, 8, 2)
    assert (zeros is None) == symmetric
    x = inputs(512).repeat(3, 1)
    torch.testing.assert_close(layer(x), F.linear(x, deq), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(method.dequantized(layer, torch.float32), deq)


def test_wna16_layer_keeps_rows_where_the_kernels_do_not_prefer_the_fragment_layout(
    monkeypatch,
):
    """On the CPU (the fragment kernels' PTX is NVIDIA's) the layer keeps the rows layout."""
    layer, _ = _frag_layer("cpu", torch.float32, True, monkeypatch)
    assert layer.quant_method._tensors(layer)[0].dim() == 2


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_wna16_layer_in_the_fragment_layout_on_the_gpu(symmetric, monkeypatch):
    """The repacked layer through the GPU kernels in bf16: the fragment kernel at 1-8 rows, the
    interleaved loop on the same words at prefill sizes."""
    layer, deq = _frag_layer("cuda", torch.bfloat16, symmetric, monkeypatch)
    assert layer.quant_method._tensors(layer)[0].dim() == 4
    for rows in (1, 3, 8, 200):
        x = inputs(512, seed=rows).repeat(rows // 5 + 1, 1)[:rows].cuda().bfloat16()
        expected = F.linear(x.float(), deq.cuda().bfloat16().float())
        torch.testing.assert_close(layer(x).float(), expected, atol=3e-2, rtol=2e-2)


# -- padded attention heads (heads that do not split over the ranks) ----------------------


class PaddingRank(Rank):
    pad_attention_heads = True


@pytest.mark.parametrize(
    "packer, kwargs, scheme_kwargs",
    [
        (gptq_pack, dict(bits=4, group_size=8, desc_act=True, sym=False),
         dict(checkpoint="gptq", bits=4, group_size=8, symmetric=False, g_idx=True)),
        (ct_pack_quantized, dict(bits=4, group_size=8),
         dict(checkpoint="ct", bits=4, group_size=8)),
    ],
    ids=["gptq-desc-act-asym", "ct-sym"],
)  # fmt: skip
def test_padded_heads_project_to_zeros(packer, kwargs, scheme_kwargs):
    """9 query / 3 KV heads over 2 ranks: 12 / 4 with zero dummy heads. Their q/k/v rows get
    zero scales (they project to zeros, whatever the packed values and zero points) and their
    o_proj columns zero weights; the ranks' o_proj outputs of the same attention add up to the
    unsharded layer's."""
    hidden, d, heads, kv_heads = 32, 8, 9, 3
    scheme = wna16(**scheme_kwargs)
    rows = {"q": heads * d, "k": kv_heads * d, "v": kv_heads * d}
    # one act-order permutation for q, k and v (GPTQ's, from their shared input)
    ckpt = {s: packer(weight(n, hidden, 40 + i), **kwargs, seed=1)[0]
            for i, (s, n) in enumerate(rows.items())}  # fmt: skip
    o_tensors, o_deq = packer(weight(hidden, heads * d, 50), **kwargs)
    x = inputs(hidden)
    full_q = build(lambda: QKVParallelLinear(hidden, d, heads, kv_heads), scheme)
    for s, tensors in ckpt.items():
        load(full_q, tensors, s)
    finish(full_q)
    attn = torch.randn(5, heads * d, generator=torch.Generator().manual_seed(2))  # any input
    expected = F.linear(attn, o_deq)
    total = 0
    for rank in range(2):
        tp = PaddingRank(rank, 2)
        qkv = build(lambda: QKVParallelLinear(hidden, d, heads, kv_heads), scheme, tp)
        for s, tensors in ckpt.items():
            load(qkv, tensors, s)
        finish(qkv)
        q, _, _ = qkv.split(qkv(x))
        real = max(0, min(qkv.num_heads * d, heads * d - rank * qkv.num_heads * d))
        assert qkv.num_dummy_heads == 3 and not q[:, real:].any()
        q_full = full_q.split(full_q(x))[0]
        start = rank * qkv.num_heads * d
        torch.testing.assert_close(q[:, :real], q_full[:, start : start + real])
        o_proj = build(lambda: RowParallelLinear(heads * d, hidden, input_padding=3 * d),
                       scheme, tp)  # fmt: skip
        load(o_proj, o_tensors)
        finish(o_proj)
        mine = torch.zeros(5, o_proj.input_size)
        mine[:, :real] = attn[:, start : start + real]
        total = total + o_proj(mine)
    torch.testing.assert_close(total, expected, atol=1e-4, rtol=1e-4)


# -- the packers against compressed-tensors' own (where it is installed) -------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_ct_packer_matches_compressed_tensors(bits):
    """`ct_pack_quantized`'s words are `pack_to_int32`'s (values and zero points, the latter
    packed along N). Checked by hand with compressed-tensors 0.20.0; runs where it is installed."""
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    from atom_models.layers.int_checkpoint import unpack_int32

    tensors, _ = ct_pack_quantized(weight(24, 64, 11), bits, 32, symmetric=False)
    offset = 1 << (bits - 1)
    signed = (unpack_int32(tensors["weight_packed"], bits) - offset).to(torch.int8)
    assert torch.equal(helpers.pack_to_int32(signed, bits), tensors["weight_packed"])
    zp = (unpack_int32(tensors["weight_zero_point"], bits, dim=0) - offset).to(torch.int8)
    assert torch.equal(helpers.pack_to_int32(zp, bits, packed_dim=0), tensors["weight_zero_point"])
