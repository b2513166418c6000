"""The bundled SmolLM2 GGUF: ATOM's logits equal transformers' load of the same file (float32)."""

from __future__ import annotations

import pytest
import torch

from atom_models import load_model
from atom_models.gguf_file import gguf_tokenizer

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "def add(a, b):\n    return",
    "Unicode: café, naïve, 東京, 🙂 —",
]


@pytest.fixture(scope="module")
def models(bundled, reference):
    return load_model(bundled, dtype=torch.float32), reference, gguf_tokenizer(bundled)


@torch.no_grad()
def test_smollm2_logits_match_transformers(models, paged_session):
    atom, hf, tokenizer = models
    batch = [tokenizer.encode(p) for p in PROMPTS]
    out = paged_session(atom, num_blocks=32, block_size=16).step(dict(enumerate(batch)))
    for i, ids in enumerate(batch):
        expected = hf(torch.tensor([ids])).logits[0]  # [n, V]
        diff = (out[i] - expected).abs().max().item()
        assert diff < 1e-3, f"prompt {i}: max |logit diff| {diff:.2e} over {len(ids)} positions"
        assert out[i][-1].argmax() == expected[-1].argmax()
