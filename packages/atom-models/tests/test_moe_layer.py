"""FusedMoE: loading both checkpoint layouts, tensor- and expert-parallel shard math (in process,
ranks simulated), and the checkpoint errors; transformers 5's stacked layout end to end."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import MixtralConfig, Qwen3MoeConfig

from atom_models import CheckpointMismatchError, load_model
from atom_models.distributed import tp_group
from atom_models.layers.moe import FusedMoE, fused_moe_mapping
from atom_models.weights import iter_safetensors, load_weights

E, H, N, K, T = 8, 32, 24, 2, 11  # experts, hidden, expert intermediate size, top-k, tokens


class Rank:
    """One rank of a simulated tensor-parallel group: collectives are left to the test."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise NotImplementedError


class Block(nn.Module):
    """The smallest model holding a FusedMoE at `mlp.experts`, loadable by the generic loader."""

    def __init__(self, tp: Rank | None = None, **kwargs) -> None:
        super().__init__()
        self.mlp = nn.Module()
        with tp_group(tp or Rank(0, 1)):
            self.mlp.experts = FusedMoE(E, H, N, **kwargs)
        self.packed_modules_mapping = fused_moe_mapping(E)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        load_weights(self, tensors.items())


def expert_tensors(seed: int = 0, bias: bool = False) -> dict[str, torch.Tensor]:
    """Per-expert gate/up/down weights as HF publishes them (+ stacked biases)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for e in range(E):
        for name, shape in (("gate_proj", (N, H)), ("up_proj", (N, H)), ("down_proj", (H, N))):
            out[f"mlp.experts.{e}.{name}.weight"] = torch.randn(shape, generator=gen) / 5
    if bias:
        out["mlp.experts.gate_up_proj_bias"] = torch.randn(E, 2 * N, generator=gen)
        out["mlp.experts.down_proj_bias"] = torch.randn(E, H, generator=gen)
    return out


def stacked(tensors: dict[str, torch.Tensor], gpt_oss: bool = False) -> dict[str, torch.Tensor]:
    """The same experts as 3-D tensors: transformers 5's layout, or GPT-OSS's (transposed,
    gate/up interleaved)."""

    def per_expert(name):
        return torch.stack([tensors[f"mlp.experts.{e}.{name}.weight"] for e in range(E)])

    gate, up, down = per_expert("gate_proj"), per_expert("up_proj"), per_expert("down_proj")
    out = {k: v for k, v in tensors.items() if k.endswith("_bias")}
    if not gpt_oss:
        out["mlp.experts.gate_up_proj"] = torch.cat((gate, up), dim=1)  # [E, 2I, H]
        out["mlp.experts.down_proj"] = down  # [E, H, N]
        return out
    out["mlp.experts.gate_up_proj"] = torch.stack((gate, up), dim=2).flatten(1, 2).transpose(1, 2)
    out["mlp.experts.down_proj"] = down.transpose(1, 2)  # [E, N, H]
    if "mlp.experts.gate_up_proj_bias" in out:
        b_gate, b_up = out["mlp.experts.gate_up_proj_bias"].chunk(2, dim=1)
        out["mlp.experts.gate_up_proj_bias"] = torch.stack((b_gate, b_up), dim=2).flatten(1, 2)
    return out


def routing(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen)
    weights, ids = torch.randn(T, E, generator=gen).softmax(-1).topk(K, dim=-1)
    return x, weights, ids.to(torch.int32)


def naive(tensors, x, weights, ids, activation="silu") -> torch.Tensor:
    out = torch.zeros(T, H)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            gate = tensors[f"mlp.experts.{e}.gate_proj.weight"] @ x[t]
            up = tensors[f"mlp.experts.{e}.up_proj.weight"] @ x[t]
            if "mlp.experts.gate_up_proj_bias" in tensors:
                b_gate, b_up = tensors["mlp.experts.gate_up_proj_bias"][e].chunk(2)
                gate, up = gate + b_gate, up + b_up
            if activation == "silu":
                act = torch.nn.functional.silu(gate) * up
            else:
                gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
                act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
            y = tensors[f"mlp.experts.{e}.down_proj.weight"] @ act
            if "mlp.experts.down_proj_bias" in tensors:
                y = y + tensors["mlp.experts.down_proj_bias"][e]
            out[t] += weights[t, k] * y
    return out


@pytest.mark.parametrize("layout", ["per-expert", "stacked", "gpt-oss"])
def test_both_layouts_load_the_same_experts(layout):
    tensors = expert_tensors(bias=layout == "gpt-oss")
    gpt_oss = layout == "gpt-oss"
    kwargs = dict(checkpoint_transposed=True, checkpoint_interleaved=True) if gpt_oss else {}
    if gpt_oss:
        kwargs.update(activation="swiglu_oai", bias=True)
    block = Block(**kwargs)
    block.load(tensors if layout == "per-expert" else stacked(tensors, gpt_oss=gpt_oss))
    x, weights, ids = routing()
    got = block.mlp.experts(x, weights, ids)
    expected = naive(tensors, x, weights, ids, "swiglu_oai" if gpt_oss else "silu")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["per-expert", "gpt-oss-stacked"])
def test_tensor_parallel_ranks_sum_to_the_full_layer(gpt_oss):
    """Each of 2 ranks holds half of every expert's intermediate dim (and rank 0 alone adds the
    down bias): their partial outputs add up to the unsharded layer's."""
    tensors = expert_tensors(seed=2, bias=gpt_oss)
    kwargs = {}
    if gpt_oss:
        kwargs = dict(checkpoint_transposed=True, checkpoint_interleaved=True)
        kwargs.update(activation="swiglu_oai", bias=True)
        tensors_in = stacked(tensors, gpt_oss=True)
    else:
        tensors_in = tensors
    full = Block(**kwargs)
    full.load(tensors_in)
    x, weights, ids = routing(seed=3)
    partial = []
    for rank in range(2):
        block = Block(Rank(rank, 2), **kwargs)
        block.load(tensors_in)
        experts = block.mlp.experts
        assert experts.w13_weight.shape == (E, N, H) and experts.w2_weight.shape == (E, H, N // 2)
        # Rank r holds rows [r*N/2, (r+1)*N/2) of every gate and up projection.
        rows = slice(rank * N // 2, (rank + 1) * N // 2)
        full_gate, full_up = full.mlp.experts.w13_weight.chunk(2, dim=1)
        gate, up = experts.w13_weight.chunk(2, dim=1)
        assert torch.equal(gate, full_gate[:, rows]) and torch.equal(up, full_up[:, rows])
        partial.append(experts(x, weights, ids))
    expected = full.mlp.experts(x, weights, ids)
    torch.testing.assert_close(partial[0] + partial[1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["per-expert", "stacked"])
def test_expert_parallel_ranks_own_their_experts(layout):
    tensors = expert_tensors(seed=4)
    tensors_in = tensors if layout == "per-expert" else stacked(tensors)
    full = Block()
    full.load(tensors_in)
    x, weights, ids = routing(seed=5)
    partial = []
    for ep_rank in range(2):
        block = Block(ep_rank=ep_rank, ep_size=2)
        block.load(tensors_in)  # strict: every expert it owns was filled, the others skipped
        experts = block.mlp.experts
        owned = slice(ep_rank * E // 2, (ep_rank + 1) * E // 2)
        assert experts.w13_weight.shape[0] == E // 2
        torch.testing.assert_close(experts.w13_weight, full.mlp.experts.w13_weight[owned])
        torch.testing.assert_close(experts.w2_weight, full.mlp.experts.w2_weight[owned])
        partial.append(experts(x, weights, ids))
    expected = full.mlp.experts(x, weights, ids)
    torch.testing.assert_close(partial[0] + partial[1], expected, atol=1e-5, rtol=1e-5)


def test_expert_parallel_passes_other_ranks_slots_as_minus_one(monkeypatch):
    """Slots routed to another rank's experts reach fused_moe as -1 (no GEMM work there), not as
    the rank's expert 0 with weight 0 (issue 37: every rank computed expert 0 for them)."""
    import atom_kernels

    calls = []
    fused_moe = atom_kernels.fused_moe

    def spy(hidden_states, w13, w2, topk_weights, topk_ids, **kwargs):
        calls.append((topk_weights, topk_ids))
        return fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, **kwargs)

    monkeypatch.setattr(atom_kernels, "fused_moe", spy)
    block = Block(ep_rank=1, ep_size=2)
    block.load(expert_tensors(seed=4))
    x, weights, ids = routing(seed=5)
    block.mlp.experts(x, weights, ids)
    ((local_weights, local_ids),) = calls
    owned = ids >= E // 2
    assert not owned.all() and owned.any()
    assert torch.equal(local_ids, torch.where(owned, ids - E // 2, -1))
    assert torch.equal(local_weights, weights)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_expert_parallel_over_the_hosts_group(bias):
    """A host group with `enable_expert_parallel`: each of its ranks holds whole experts (the
    intermediate dim not split), every rank adds its own experts' down biases, and the outputs sum
    (the layer's all-reduce, left to the test here) to the unsplit layer's."""
    tensors = expert_tensors(seed=6, bias=bias)
    tensors_in = stacked(tensors) if bias else tensors
    full = Block(bias=bias)
    full.load(tensors_in)
    x, weights, ids = routing(seed=7)
    partial = []
    for rank in range(2):
        group = Rank(rank, 2)
        group.enable_expert_parallel = True
        block = Block(group, bias=bias)
        block.load(tensors_in)
        experts = block.mlp.experts
        assert (experts.ep_rank, experts.ep_size, experts.tp_size) == (rank, 2, 1)
        assert experts.w13_weight.shape == (E // 2, 2 * N, H)
        owned = slice(rank * E // 2, (rank + 1) * E // 2)
        torch.testing.assert_close(experts.w2_weight, full.mlp.experts.w2_weight[owned])
        partial.append(experts(x, weights, ids))
    expected = full.mlp.experts(x, weights, ids)
    torch.testing.assert_close(partial[0] + partial[1], expected, atol=1e-5, rtol=1e-5)


def test_checkpoint_errors_name_the_expert():
    tensors = expert_tensors()
    del tensors["mlp.experts.5.up_proj.weight"]
    with pytest.raises(CheckpointMismatchError, match=r"experts\.w13_weight \(shards .*5, 'w3'"):
        Block().load(tensors)
    tensors = expert_tensors()
    tensors["mlp.experts.2.down_proj.weight"] = torch.zeros(H, N + 1)
    with pytest.raises(CheckpointMismatchError, match=r"expert 2 w2: .* shape \(32, 25\)"):
        Block().load(tensors)
    with pytest.raises(CheckpointMismatchError, match=r"expected \(8, 32, 48\) \(\[E, in, out\]"):
        Block(checkpoint_transposed=True).load(stacked(expert_tensors()))


TINY = dict(
    vocab_size=97,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


@pytest.mark.parametrize(
    ("config", "per_expert_key"),
    [
        (
            MixtralConfig(**TINY, intermediate_size=16, num_local_experts=4),
            "model.layers.0.block_sparse_moe.experts.3.w1.weight",
        ),
        (
            Qwen3MoeConfig(
                **TINY,
                head_dim=8,
                intermediate_size=48,
                moe_intermediate_size=16,
                num_experts=4,
                mlp_only_layers=[1],
            ),
            "model.layers.0.mlp.experts.3.gate_proj.weight",
        ),
    ],
    ids=["mixtral", "qwen3_moe"],
)
def test_transformers_stacked_save_loads_like_the_published_layout(
    config, per_expert_key, make_checkpoint, tmp_path
):
    """`save_pretrained` writes the published per-expert names; with save_original_format=False
    it writes transformers 5's own stacked tensors (Mixtral's block renamed to `mlp`). Both load
    into the same parameters."""
    path, hf = make_checkpoint(config)
    assert per_expert_key in dict(iter_safetensors(path))
    hf.save_pretrained(tmp_path, save_original_format=False)
    names = dict(iter_safetensors(tmp_path))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    assert "model.layers.0.mlp.experts.down_proj" in names
    published, native = load_model(path), load_model(tmp_path)
    native_params = dict(native.named_parameters())
    for name, param in published.named_parameters():
        assert torch.equal(param, native_params[name]), name
