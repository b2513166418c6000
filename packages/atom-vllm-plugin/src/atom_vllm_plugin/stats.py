"""Per-process counters that show a run really went through ATOM's code (read back by tests).

Plain integer increments: cheap enough to stay on in production.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class Counters:
    models_built: int = 0  # AtomForCausalLM instances constructed
    models_handed_back: int = 0  # configurations handed to vLLM's own model class instead
    model_forwards: int = 0  # AtomForCausalLM.forward calls
    attention_impls: int = 0  # AtomAttentionImpl instances constructed (one per layer)
    attention_forwards: int = 0  # AtomAttentionImpl.forward calls with metadata (all layers)
    kv_cache_writes: int = 0  # AtomAttentionImpl.do_kv_cache_update calls

    def snapshot(self) -> dict[str, int]:
        return asdict(self)


counters = Counters()
