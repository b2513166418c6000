from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from atom_models.quantization import process_weights_after_loading
from atom_models.weights import load_weights


class CausalLMBase(nn.Module):
    """What every `<Arch>ForCausalLM` shares: weight loading by name and the LM head.

    Subclasses set `self.model` and `self.lm_head` and declare `packed_modules_mapping`
    (checkpoint module name -> (fused parameter module name, shard id)).
    """

    packed_modules_mapping: dict[str, tuple[str, int | str]] = {}

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, vocab]. Kept out of forward so the LM head stays out of graphs."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by name; returns the parameter names that were loaded."""
        loaded = load_weights(self, weights)
        process_weights_after_loading(self)
        return loaded
