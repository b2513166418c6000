"""atom-engine: continuous batching over a paged KV cache, an offline API and an OpenAI server."""

from atom_engine.config import EngineConfig
from atom_engine.engine import LLMEngine
from atom_engine.llm import LLM
from atom_engine.outputs import CompletionOutput, Logprob, RequestOutput
from atom_engine.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
]
