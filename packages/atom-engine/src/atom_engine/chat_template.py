"""Chat messages -> prompt token ids with the model's chat template (LLM.chat, server, CLI)."""

from __future__ import annotations

import functools
import re
from typing import Any

# apply_chat_template arguments that decide what it returns: the server sets them itself.
_RESERVED_KWARGS = frozenset({
    "conversation", "tokenize", "return_dict", "return_tensors", "padding", "truncation",
    "max_length", "add_generation_prompt", "continue_final_message", "tools", "documents",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "chat_template",
})  # fmt: skip


def message_text(content: str | list | None) -> str:
    """A message's text: a string, or the text parts of a content list joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        part = part if isinstance(part, dict) else part.model_dump()
        if part.get("type") != "text":
            raise ValueError(f"only text content parts are supported, got {part.get('type')!r}")
        texts.append(part.get("text") or "")
    return "\n".join(texts)


def template_reads(tokenizer, chat_template: str | None, name: str) -> bool:
    """Whether the chat template a request renders with (`chat_template`, else the tokenizer's
    own) reads the variable `name` (e.g. GPT-OSS's `reasoning_effort`)."""
    template = chat_template
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template]
    return any(name in _variables(t) for t in templates if isinstance(t, str))


_WORDS = re.compile(r"[A-Za-z_]\w*")


@functools.lru_cache(maxsize=16)
def _variables(template: str) -> frozenset[str]:
    """The undeclared variables of a Jinja template (those the caller may pass)."""
    import jinja2
    import jinja2.meta

    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateSyntaxError:  # a tag only transformers knows ({% generation %})
        return frozenset(_WORDS.findall(template))


def apply_chat_template(
    tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    chat_template: str | None = None,
    max_chars: int | None = None,
    tools: list[dict[str, Any]] | None = None,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of `messages` rendered by `chat_template` (a Jinja string), or by the tokenizer's
    own template when it is None; `tools` (OpenAI tool definitions) are handed to the template.
    `add_special_tokens`: the tokenizer's own (BOS, ...) added on top of what the template writes
    (vLLM's `/tokenize` option; off for generation).

    Raises ValueError when there is no template, the template refuses the conversation, or the
    rendered text is longer than `max_chars` (checked before it is tokenized).
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template (use plain completions)")
    if not messages:
        raise ValueError("messages must not be empty")
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs a final assistant message")
    kwargs = dict(chat_template_kwargs or {})
    reserved = sorted(_RESERVED_KWARGS & kwargs.keys())
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(reserved)}")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    if tools:
        kwargs["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as e:  # jinja2 errors (raise_exception in templates), bad kwargs
        raise ValueError(f"the chat template failed: {e}") from None
    if max_chars is not None and len(text) > max_chars:
        raise ValueError(
            f"the conversation renders to {len(text)} characters: more tokens than the model's "
            "context length (max_model_len)"
        )
    # What apply_chat_template(tokenize=True) does: the template writes the special tokens.
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
