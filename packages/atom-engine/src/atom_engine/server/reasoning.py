"""Reasoning in a model's text: `<think>…</think>` -> `reasoning_content`, the rest `content`,
chosen with `atom serve --reasoning-parser NAME` (vLLM's names):

- `deepseek_r1` (DeepSeek-R1 and its distills): the chat template opens `<think>` in the prompt,
  so the reply is reasoning up to `</think>` (an opening `<think>` is dropped if the model writes
  one); with no `</think>` the whole reply is reasoning (cut short).
- `qwen3` (Qwen3; `chat_template_kwargs: {"enable_thinking": false}` turns thinking off): a reply
  that opens with `<think>` is reasoning up to `</think>` (all of it if there is none); any other
  reply is content.

`split(text, final)` -> (reasoning, content), None for an empty part; the content after
`</think>` loses its leading whitespace. While streaming (`final=False`) a tag cut at the end of
the text is held back, so the parts of a longer text always extend those of a shorter one.
"""

from __future__ import annotations

START, END = "<think>", "</think>"


def _cut_tag(text: str, tag: str) -> str:
    """`text` without a trailing proper prefix of `tag` (a tag still arriving)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return text[:-size]
    return text


class ReasoningParser:
    name = ""
    implicit_start = False  # reasoning without an opening <think> (the prompt opened it)

    def split(self, text: str, final: bool = True) -> tuple[str | None, str | None]:
        lead = text.lstrip()
        if not final and START.startswith(lead) and lead != START:
            return None, None  # maybe "<think>" arriving
        opened = lead.startswith(START)
        if opened:
            text = lead[len(START) :]
        elif not self.implicit_start:
            return None, text or None
        reasoning, sep, content = text.partition(END)
        if not sep and not final:
            reasoning = _cut_tag(reasoning, END)
        content = content.lstrip()
        return reasoning or None, content or None


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    implicit_start = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}
