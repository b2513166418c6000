"""What the graphs read of the model runner whose forward they capture: a protocol, so the graph
modules need nothing of `model_runner` (the runner builds the graphs, never the other way)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from atom_engine.config import EngineConfig


class GraphTarget(Protocol):
    """One rank's model and KV-cache geometry (`ModelRunner` is one)."""

    config: EngineConfig
    model: nn.Module
    device: torch.device
    block_size: int
    max_model_len: int
    show_progress: bool  # a bar over the capture sizes (rank 0, `EngineConfig.show_progress`)
