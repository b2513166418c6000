"""A tiktoken tokenizer shipped as checkpoint code, shaped like Kimi-K2's `tokenization_kimi.py`
(a `TikTokenTokenizer` over `tiktoken.model`, special tokens after the byte-pair ranks, reserved
ones up to the model's vocabulary). test_trust_remote_code.py copies it into a checkpoint, whose
tokenizer_config.json maps AutoTokenizer to it; transformers imports it from there."""

from __future__ import annotations

import base64
from pathlib import Path

import tiktoken
from transformers import PreTrainedTokenizer

# GPT-2's split pattern; Kimi's adds Han runs and digit groups.
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|im_system|>", "<|im_user|>", "<|im_assistant|>",
                  "<|im_end|>"]  # fmt: skip
NUM_TOKENS = 320  # byte-pair ranks, the special tokens above, then reserved special tokens


def load_ranks(path: str) -> dict[bytes, int]:
    """tiktoken.model: one `base64(token) rank` per line (tiktoken's own format)."""
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token="<|bos|>", eos_token="<|eos|>", **kwargs):
        ranks = load_ranks(vocab_file)
        names = SPECIAL_TOKENS + [
            f"<|reserved_token_{i}|>" for i in range(NUM_TOKENS - len(ranks) - len(SPECIAL_TOKENS))
        ]
        self.special_ids = {name: len(ranks) + i for i, name in enumerate(names)}
        self.model = tiktoken.Encoding(
            name=Path(vocab_file).name,
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=self.special_ids,
        )
        # Tokens as strings: byte tokens by their latin-1 text, special ones by name.
        self.decoder = {i: t.decode("latin-1") for t, i in ranks.items()}
        self.decoder.update({i: name for name, i in self.special_ids.items()})
        self.encoder = {t: i for i, t in self.decoder.items()}
        self.vocab_file = vocab_file
        super().__init__(bos_token=bos_token, eos_token=eos_token, **kwargs)

    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def encode(self, text, add_special_tokens: bool = True, **kwargs) -> list[int]:
        ids = self.model.encode(text, allowed_special="all")
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if skip_special_tokens:
            special = set(self.special_ids.values())
            token_ids = [t for t in token_ids if t not in special]
        return self.model.decode_bytes(token_ids).decode("utf-8", errors="replace")

    def _tokenize(self, text: str, **kwargs) -> list[str]:
        return [self.decoder[i] for i in self.model.encode(text, allowed_special="all")]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        data = b"".join(t.encode("latin-1") for t in tokens if t not in self.special_ids)
        return data.decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None):
        return (self.vocab_file,)
