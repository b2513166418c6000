"""`EngineFront`: what an engine needs to meet a request before it is queued — the model's config,
tokenizer, stop tokens, grammar compiler and limits — without the model.

Every `LLMEngine` has one. The data-parallel front (`server.data_parallel`) has one of its own in
the server's process, where no model is loaded: its replicas' engines run in processes of their
own, and the server checks, tokenizes and compiles grammars here before handing a request over.
"""

from __future__ import annotations

import copy
import logging

from atom_engine.config import EngineConfig
from atom_engine.hub import resolve_model, resolve_tokenizer
from atom_engine.intake import check_request
from atom_engine.parallel import check_parallel
from atom_engine.sampling_params import SamplingParams
from atom_engine.spec_decode import check_speculative
from atom_engine.structured_output import GrammarCompiler
from atom_engine.tokenizer import eos_token_ids, load_tokenizer
from atom_models import load_config

logger = logging.getLogger("atom_engine")


class EngineFront:
    """The request-facing part of an engine. `num_kv_tokens` (the KV cache's capacity, which a
    request must fit) is set once the cache is sized."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # A Hub ID becomes a local snapshot here, once: workers and replicas get the path.
        self.model_path = resolve_model(
            config.model,
            revision=config.revision,
            download_dir=config.download_dir,
            gguf_file=config.gguf_file,
            weights=config.load_format != "dummy",
        )
        self.tokenizer_path = (
            resolve_tokenizer(config.tokenizer, download_dir=config.download_dir)
            if config.tokenizer is not None and not config.skip_tokenizer_init
            else self.model_path
        )
        trust = config.trust_remote_code
        self.hf_config = load_config(self.model_path, trust_remote_code=trust)
        check_parallel(config, self.hf_config)  # before anything slow
        check_speculative(config.resolved_speculative_config(), config, self.hf_config)
        self.tokenizer = (
            None
            if config.skip_tokenizer_init
            else load_tokenizer(self.tokenizer_path, trust_remote_code=trust)
        )
        self.eos_token_ids = eos_token_ids(self.model_path, self.hf_config, self.tokenizer)
        self.grammars = GrammarCompiler(  # its own tokenizer: it may compile on any thread
            copy.deepcopy(self.tokenizer), self.hf_config.vocab_size, self.eos_token_ids
        )
        context = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        self.max_model_len = config.max_model_len or context
        if self.max_model_len > context:
            logger.warning(
                "max_model_len %d exceeds the model's context %d", self.max_model_len, context
            )
        self.vocab_size = self.hf_config.vocab_size
        self.num_kv_tokens = 0

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError when a request can never run (`intake.check_request`); fills
        params' per-model defaults and compiles its grammar. Safe from any thread."""
        check_request(token_ids, params, self.vocab_size, self.max_model_len, self.num_kv_tokens)
        if params.structured_outputs is not None and params.compiled_grammar is None:
            params.compiled_grammar = self.grammars.compile(params.structured_outputs)
