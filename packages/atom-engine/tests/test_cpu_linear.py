"""The CPU engine's linear layers on oneDNN-packed weights (`atom_engine.cpu_linear`): every
unquantized float32 layer gets a packed copy, greedy tokens of batched decodes (the packed row
counts) equal transformers', and `ATOM_CPU_PACKED_LINEAR=0` or tensor parallelism leave the layers
alone. The kernel itself is tested against the torch reference in atom-kernels'
test_cpu_backend.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from atom_engine import LLM, SamplingParams
from atom_engine.cpu_linear import ENV_VAR, ONEDNN_LINEAR, pack_linears
from atom_kernels.backends.cpu import onednn_linear
from atom_models.layers.linear import UNQUANTIZED, LinearBase

pytestmark = pytest.mark.skipif(
    not onednn_linear.can_pack(torch.zeros(2, 2)), reason="torch without oneDNN"
)

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):", "Once upon a time,"]


def _linears(model) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def test_smollm2_layers_are_packed(smollm2_llm):
    layers = _linears(smollm2_llm.engine.runner.model)
    assert len(layers) == 4 * 30  # qkv, o, gate_up, down of 30 layers
    assert all(layer.quant_method is ONEDNN_LINEAR for layer in layers)


def test_tiny_model_matches_transformers_batched(tiny_checkpoint, greedy_reference, monkeypatch):
    """4 sequences decode together (4-row GEMMs: the packed copies) and 1 alone (F.linear)."""
    config = Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    path, hf_model = tiny_checkpoint(config, seed=5)
    monkeypatch.delenv(ENV_VAR, raising=False)
    llm = LLM(str(path), dtype="float32", device="cpu")
    assert all(layer.quant_method is ONEDNN_LINEAR for layer in _linears(llm.engine.runner.model))
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    expected = [greedy_reference(hf_model.float(), ids, 12, None) for ids in prompt_ids]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                           use_tqdm=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in outputs] == expected
    (alone,) = llm.generate([{"prompt_token_ids": prompt_ids[0]}], params, use_tqdm=False)
    assert alone.outputs[0].token_ids == expected[0]

    # Off by the switch, and with tensor parallelism: nothing packed.
    model = torch.nn.Sequential(*_fresh_linears(2))
    monkeypatch.setenv(ENV_VAR, "0")
    assert pack_linears(model, torch.device("cpu"), 1) == 0
    monkeypatch.delenv(ENV_VAR)
    assert pack_linears(model, torch.device("cpu"), 2) == 0
    assert all(layer.quant_method is UNQUANTIZED for layer in _linears(model))
    assert pack_linears(model, torch.device("cpu"), 1) == 2


def _fresh_linears(num: int) -> list[LinearBase]:
    from atom_models.layers.linear import ReplicatedLinear

    layers = [ReplicatedLinear(16, 8, bias=False) for _ in range(num)]
    for layer in layers:
        layer.weight.data.normal_()
    return layers
