"""The offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Sequence
from dataclasses import replace

from tqdm.auto import tqdm

from atom_engine.chat_template import apply_chat_template
from atom_engine.config import EngineConfig
from atom_engine.engine import LLMEngine
from atom_engine.outputs import RequestOutput
from atom_engine.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """An engine for offline batched generation (vLLM-shaped: switch with one import).

    `model` is a Hugging Face Hub ID (`org/name`, fetched through the HF cache: `atom_engine.hub`),
    a local HF checkpoint directory or a .gguf file; omitted, the bundled SmolLM2.
    Other keyword arguments are `EngineConfig` fields (dtype, device, max_model_len, ...).
    With `data_parallel_size` N the replicas are processes of their own (as under `atom serve`),
    each request to the least loaded; `engine` is then their front (`EngineFront`: tokenizer,
    config) and `replicas` the `DataParallelEngine`.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        config = EngineConfig(model=model, **engine_args)
        self.shut_down = False
        self.replicas = None
        if config.node_rank > 0:
            self._run_node(config)
            return
        if config.data_parallel_size > 1:
            from atom_engine.server.data_parallel import DataParallelEngine

            self.replicas = DataParallelEngine.from_config(config)
            self.engine = self.replicas.engine
        else:
            self.engine = LLMEngine(config)
        self._ids = itertools.count()

    def _run_node(self, config: EngineConfig) -> None:
        """`LLM(node_rank=R)`, R > 0, as SGLang's Engine there: run this node's ranks until node
        0 ends them (NodeError if one failed), then stand shut down: node 0 generates."""
        from atom_engine.node_agent import run_node
        from atom_engine.nodes import NodeError

        self.shut_down, self.engine = True, None
        if run_node(config) != 0:
            raise NodeError(f"node {config.node_rank}'s ranks failed (their log says why)")

    def shutdown(self) -> None:
        """Stop the engine's worker (and replica) processes (also done when it is collected);
        `generate` raises after it."""
        self.shut_down = True
        if self.replicas is not None:
            self.replicas.shutdown()
        elif self.engine is not None:
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
        if self.shut_down:
            raise RuntimeError("this LLM was shut down: build a new one to generate")
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
        if self.replicas is not None:
            return _run_coroutine(self._run_replicas(prompts, params_list, use_tqdm))
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

    async def _run_replicas(self, prompts, params_list, use_tqdm: bool) -> list[RequestOutput]:
        """The data-parallel replicas' `_run`: every request added at once, its final output
        awaited (a request a replica fails raises here, as a bad request does)."""
        bar = tqdm(total=len(prompts), desc="Generating", disable=not use_tqdm, unit="req")

        async def one(prompt, params) -> RequestOutput:
            request_id = str(next(self._ids))
            stream = await self.replicas.add_request(
                request_id, prompt, replace(params, output_kind="final_only")
            )
            final = None
            async for output in stream:
                final = output
            bar.update(1)
            return final

        pairs = zip(prompts, params_list, strict=True)
        tasks = [asyncio.ensure_future(one(prompt, params)) for prompt, params in pairs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # on an error the others end too (leaving a stream aborts it)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            bar.close()

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


def _run_coroutine(coro):
    """Run `coro` to its end from synchronous code, on a thread of its own when this thread
    already runs an event loop (a notebook)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    result: list = []

    def run() -> None:
        try:
            result.append(asyncio.run(coro))
        except BaseException as e:
            result.append(e)

    thread = threading.Thread(target=run, name="atom-llm")
    thread.start()
    thread.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]
