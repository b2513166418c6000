"""POST /tokenize and /detokenize, as vLLM serves them: a prompt, or messages through the chat
template exactly as a chat completion renders them, to token ids (with their count, the context
length and, on request, the tokens' strings); token ids back to text. The tokenizer runs on the
preprocess threads, each with its own copy (`preprocess.py`)."""

from __future__ import annotations

from atom_engine.chat_template import apply_chat_template
from atom_engine.server.protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from atom_engine.server.responses import DetokenizeResponse, TokenizeResponse
from atom_engine.server.serving_chat import chat_messages
from atom_engine.server.serving_common import APIError, ServerState


def _need_tokenizer(state: ServerState) -> None:
    if state.engine.tokenizer is None:
        raise APIError(
            "the server runs without a tokenizer: it cannot tokenize or detokenize text",
            param="model",
        )


async def tokenize(
    state: ServerState, request: TokenizeCompletionRequest | TokenizeChatRequest
) -> TokenizeResponse:
    state.check_model(request.model)
    _need_tokenizer(state)
    preprocessor = state.preprocessor
    if isinstance(request, TokenizeChatRequest):
        messages = chat_messages(request.messages)
        tools = [t.model_dump(exclude_none=True) for t in request.tools or []]

        def encode() -> list[int]:
            return apply_chat_template(
                preprocessor.tokenizer,
                messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.chat_template_kwargs,
                request.chat_template,
                tools=tools,
                add_special_tokens=request.add_special_tokens,
            )

        param = "messages"
    else:

        def encode() -> list[int]:
            return preprocessor.tokenizer.encode(
                request.prompt, add_special_tokens=request.add_special_tokens
            )

        param = "prompt"

    def run() -> tuple[list[int], list[str] | None]:
        tokens = encode()
        if not request.return_token_strs:
            return tokens, None
        return tokens, preprocessor.tokenizer.convert_ids_to_tokens(tokens)

    try:
        tokens, token_strs = await preprocessor.run(run)
    except ValueError as e:
        raise APIError(str(e), param=param) from None
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=state.engine.max_model_len,
        tokens=tokens,
        token_strs=token_strs,
    )


async def detokenize(state: ServerState, request: DetokenizeRequest) -> DetokenizeResponse:
    state.check_model(request.model)
    _need_tokenizer(state)
    vocab = state.engine.engine.vocab_size
    bad = [t for t in request.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(f"tokens must be token ids in [0, {vocab}), got {bad[:5]}", param="tokens")
    preprocessor = state.preprocessor
    prompt = await preprocessor.run(lambda: preprocessor.tokenizer.decode(request.tokens))
    return DetokenizeResponse(prompt=prompt)
