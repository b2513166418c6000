"""atom-models: Hugging Face architectures built from host-agnostic layers."""

from atom_models.forward_context import get_forward_context, set_forward_context
from atom_models.loader import build_model, load_config, load_model
from atom_models.registry import get_model_class, supported_architectures
from atom_models.weights import CheckpointMismatchError

__version__ = "0.1.0"

__all__ = [
    "CheckpointMismatchError",
    "build_model",
    "get_forward_context",
    "get_model_class",
    "load_config",
    "load_model",
    "set_forward_context",
    "supported_architectures",
]
