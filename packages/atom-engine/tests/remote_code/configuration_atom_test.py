"""A configuration class shipped as checkpoint code (test_trust_remote_code.py copies it into a
checkpoint whose config.json maps AutoConfig to it): a Llama config whose context length is
given in thousands of tokens, `context_k`, which only this code turns into
`max_position_embeddings`."""

from __future__ import annotations

from transformers import LlamaConfig


class AtomTestLlamaConfig(LlamaConfig):
    model_type = "atom_test_llama"

    def __init__(self, context_k: int = 1, **kwargs):
        kwargs["max_position_embeddings"] = 1024 * context_k
        super().__init__(**kwargs)
        self.context_k = context_k
