"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tqdm.auto import tqdm

from atom_engine.chat_template import apply_chat_template
from atom_engine.config import EngineConfig
from atom_engine.engine import LLMEngine
from atom_engine.outputs import RequestOutput
from atom_engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """An engine for offline batched generation (vLLM-shaped: switch with one import).

    `model` is a local HF checkpoint directory or a .gguf file; omitted, the bundled SmolLM2.
    Other keyword arguments are `EngineConfig` fields (dtype, device, max_model_len, ...).
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (also done when it is collected)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or {"prompt_token_ids": [...]}); outputs in order."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                    "pass one, or one per prompt"
                )
        return self._run(prompts, params_list, use_tqdm)

    def _run(self, prompts, params_list, use_tqdm: bool) -> list[RequestOutput]:
        from dataclasses import replace

        ids = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                request_id = str(next(self._ids))
                # Each request gets its own copy: the engine fills in per-request fields. Only
                # finished outputs are read here.
                params = replace(params, output_kind="final_only")
                self.engine.add_request(request_id, prompt, params)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Reply to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.apply_chat_template(
                    c, add_generation_prompt, chat_template_kwargs
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, kwargs: dict | None = None
    ) -> list[int]:
        if self.engine.tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        return apply_chat_template(
            self.engine.tokenizer, messages, add_generation_prompt, chat_template_kwargs=kwargs
        )
