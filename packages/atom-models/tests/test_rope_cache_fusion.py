"""The rotary embedding inside the KV-cache write (`Attention.forward_rope`, `NativeAttention.
takes_rope`): where the kernel backend has its own `rotary_embedding_and_cache` (here the torch
backend, whose reference is the op's oracle), Llama and Qwen3 layers hand q and k over un-rotated
and the layer's one op rotates them and writes K/V; the logits still match transformers over a
prefill, a chunk over a cached prefix and decode steps (GLM-4-MoE: partial rotary; GPT-OSS:
sinks, YaRN, a sliding window). On the CPU backend (its own cache write)
and with ATOM_FUSED_ROPE_CACHE=0, nothing fuses, and a host without `takes_rope` (vLLM, SGLang)
gets q and k rotated."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from transformers import Glm4MoeConfig, GptOssConfig, LlamaConfig, Qwen3Config

import atom_kernels.backends.torch  # noqa: F401  (registers the torch ops)
from atom_kernels import registry
from atom_models import load_model
from atom_models.layers.attention import Attention, attention_host
from atom_models.layers.rotary import get_rope
from atom_models.native_host import attention as native
from atom_models.native_host import cache_layers

BASE = dict(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    num_attention_heads=4,
    num_key_value_heads=2,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**BASE, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True),
    # q/k norms and rotary on half of each head; layer 0 dense, layer 1 routed
    "glm4_moe": lambda: Glm4MoeConfig(
        **BASE,
        head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        use_qk_norm=True,
        tie_word_embeddings=False,
    ),  # fmt: skip
    # sinks, YaRN, a sliding window on layer 0
    "gpt_oss": lambda: GptOssConfig(
        **{**BASE, "intermediate_size": 32},
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),  # fmt: skip
}
PROMPT_LENGTHS = [7, 23, 1, 12]


@pytest.fixture
def torch_backend(monkeypatch):
    """The CPU's ops from the torch backend (which has the fused op), counting the fused op's
    calls; the process's backend choice comes back afterwards."""
    calls = []
    fused = registry._IMPLS["torch"]["rotary_embedding_and_cache"]

    def counting(*args):
        calls.append(args[1].shape[0])
        return fused(*args)

    monkeypatch.setitem(registry._IMPLS["torch"], "rotary_embedding_and_cache", counting)
    previous = os.environ.get(registry.ENV_VAR)
    os.environ[registry.ENV_VAR] = "torch"
    registry._reset_for_tests()
    try:
        yield calls
    finally:
        if previous is None:
            del os.environ[registry.ENV_VAR]
        else:
            os.environ[registry.ENV_VAR] = previous
        registry._reset_for_tests()


def _prompts(vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def _run(model, session_cls, batch) -> tuple[dict[int, torch.Tensor], int]:
    """(every sequence's logits [n, V], the step count): a third prefilled, a third as a chunk
    over the cached prefix, the rest decoded one token a step."""
    session = session_cls(model, seed=3)
    logits = {i: [] for i in range(len(batch))}
    cut = {i: max(1, len(t) // 3) for i, t in enumerate(batch)}
    cut2 = {i: max(cut[i], 2 * len(t) // 3) for i, t in enumerate(batch)}
    steps = [{i: t[: cut[i]] for i, t in enumerate(batch)}]
    steps.append({i: t[cut[i] : cut2[i]] for i, t in enumerate(batch) if cut2[i] > cut[i]})
    position = dict(cut2)
    while any(position[i] < len(t) for i, t in enumerate(batch)):
        steps.append({i: [t[position[i]]] for i, t in enumerate(batch) if position[i] < len(t)})
        position = {i: p + (1 if p < len(batch[i]) else 0) for i, p in position.items()}
    for chunks in steps:
        for i, out in session.step(chunks).items():
            logits[i].append(out)
    return {i: torch.cat(parts) for i, parts in logits.items()}, len(steps)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_layers_match_transformers(name, make_checkpoint, paged_session, torch_backend):
    path, hf = make_checkpoint(CONFIGS[name]())
    model = load_model(path, dtype=torch.float32)
    batch = _prompts(hf.config.vocab_size)
    got, num_steps = _run(model, paged_session, batch)
    assert len(torch_backend) == hf.config.num_hidden_layers * num_steps  # every layer, step
    layers = cache_layers(model)
    assert all(layer.rope is not None for layer in layers)
    if name in ("qwen3", "glm4_moe"):  # the q/k norms went along
        assert all(layer.rope[1] is not None for layer in layers)
    for i, tokens in enumerate(batch):
        with torch.no_grad():
            expected = hf(torch.tensor([tokens])).logits[0]
        diff = (got[i] - expected).abs().max()
        assert diff < 1e-4, f"{name} sequence {i}: max abs diff {diff:.3e}"


def test_switch_off_and_cpu_backend_keep_the_ops_apart(make_checkpoint, paged_session, monkeypatch):
    path, hf = make_checkpoint(CONFIGS["qwen3"]())
    model = load_model(path, dtype=torch.float32)
    batch = _prompts(hf.config.vocab_size)
    expected, _ = _run(model, paged_session, batch)  # the CPU backend: no fused op of its own
    assert all(layer.rope is None for layer in cache_layers(model))
    monkeypatch.setattr(native, "FUSE_ROPE_CACHE", False)
    calls = []
    monkeypatch.setitem(
        registry._IMPLS["torch"], "rotary_embedding_and_cache", lambda *a: calls.append(a)
    )
    monkeypatch.setenv(registry.ENV_VAR, "torch")
    registry._reset_for_tests()
    try:
        got, _ = _run(load_model(path, dtype=torch.float32), paged_session, batch)
    finally:
        monkeypatch.delenv(registry.ENV_VAR)
        registry._reset_for_tests()
    assert not calls
    for i in expected:
        torch.testing.assert_close(got[i], expected[i], rtol=1e-5, atol=1e-5)


class _ForeignImpl(nn.Module):
    """A host's attention module without `takes_rope` (as vLLM's and SGLang's)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, q, k, v, sinks):
        self.seen.append((q, k))
        return q


class _ForeignHost:
    def make_attention(self, spec):
        return _ForeignImpl()


def test_a_host_without_takes_rope_gets_rotated_q_and_k():
    with attention_host(_ForeignHost()):
        attn = Attention(2, 8, 8**-0.5, 1, prefix="model.layers.0.self_attn.attn")
    rope = get_rope(8, 64, 10000.0)
    positions = torch.tensor([0, 5, 9])
    q, k, v = torch.randn(3, 16), torch.randn(3, 8), torch.randn(3, 8)
    out = attn.forward_rope(positions, q, k, v, rope)
    q_rot, k_rot = rope(positions, q, k)
    torch.testing.assert_close(out, q_rot, rtol=0, atol=0)
    torch.testing.assert_close(attn.impl.seen[0][1], k_rot, rtol=0, atol=0)
