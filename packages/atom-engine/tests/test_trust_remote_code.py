"""`trust_remote_code` / `--trust-remote-code`: a checkpoint's own tokenizer code (a tiktoken
tokenizer shaped like Kimi-K2's, `remote_code/tokenization_kimi.py`) and configuration code
(`remote_code/configuration_atom_test.py`) load through `transformers`' `auto_map` when trusted,
in the engine, its tensor-parallel workers, its data-parallel replicas and the CLI; untrusted,
one error names the flag."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from atom_engine import LLM, SamplingParams
from atom_models.testing import save_random_checkpoint

pytest.importorskip("tiktoken")

REMOTE_CODE = Path(__file__).parent / "remote_code"
# Byte-pair merges after the 256 byte tokens: "hello" and " world" become one token each.
MERGES = [b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor", b"ld", b" world"]
HELLO, WORLD = 256 + MERGES.index(b"hello"), 256 + MERGES.index(b" world")
BOS, EOS = 256 + len(MERGES), 256 + len(MERGES) + 1  # the first special tokens
IM_USER, IM_ASSISTANT, IM_END = BOS + 3, BOS + 4, BOS + 5
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>{% endif %}"
)
ENGINE = dict(dtype="float32", device="cpu", enforce_eager=True, cpu_kv_cache_space=0.05)


def _tiny_llama(**overrides) -> LlamaConfig:
    fields = dict(
        vocab_size=320,  # tokenization_kimi.NUM_TOKENS
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=BOS,
        eos_token_id=EOS,
        tie_word_embeddings=False,
    )
    return LlamaConfig(**{**fields, **overrides})


def _add_custom_tokenizer(path: Path) -> None:
    """tiktoken.model, tokenization_kimi.py and a tokenizer_config.json whose auto_map names it."""
    ranks = [bytes([b]) for b in range(256)] + MERGES
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(ranks)]
    (path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    shutil.copy(REMOTE_CODE / "tokenization_kimi.py", path)
    tokenizer_config = {
        "tokenizer_class": "TikTokenTokenizer",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 256,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.fixture(scope="module")
def custom_tokenizer_checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama whose tokenizer is the checkpoint's own code."""
    path = tmp_path_factory.mktemp("kimi_tokenizer")
    save_random_checkpoint(_tiny_llama(), path, seed=3)
    _add_custom_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def custom_config_checkpoint(tmp_path_factory) -> Path:
    """The same, with a configuration class of its own too: model_type `atom_test_llama`, which
    transformers lacks, and a context of `context_k` thousand tokens."""
    path = tmp_path_factory.mktemp("custom_config")
    save_random_checkpoint(_tiny_llama(), path, seed=3)
    _add_custom_tokenizer(path)
    shutil.copy(REMOTE_CODE / "configuration_atom_test.py", path)
    config = json.loads((path / "config.json").read_text())
    del config["max_position_embeddings"]
    config.update(
        model_type="atom_test_llama",
        auto_map={"AutoConfig": "configuration_atom_test.AtomTestLlamaConfig"},
        context_k=2,
    )
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_untrusted_custom_tokenizer_names_the_flag(custom_tokenizer_checkpoint):
    with pytest.raises(ValueError, match="--trust-remote-code") as info:
        LLM(model=str(custom_tokenizer_checkpoint), **ENGINE)
    assert "tokenization_kimi.py" in str(info.value)
    assert "TikTokenTokenizer" in str(info.value)


def test_trusted_custom_tokenizer_tokenizes_generates_and_chats(custom_tokenizer_checkpoint):
    llm = LLM(model=str(custom_tokenizer_checkpoint), trust_remote_code=True, **ENGINE)
    try:
        tokenizer = llm.get_tokenizer()
        # The checkpoint's class, imported by transformers from the directory.
        assert type(tokenizer).__name__ == "TikTokenTokenizer"
        assert type(tokenizer).__module__.startswith("transformers_modules")
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        (out,) = llm.generate("hello world", params, use_tqdm=False)
        assert out.prompt_token_ids == [BOS, HELLO, WORLD]  # its merges and its BOS
        completion = out.outputs[0]
        assert len(completion.token_ids) == 4
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        (reply,) = llm.chat([{"role": "user", "content": "hello"}], params, use_tqdm=False)
        assert reply.prompt_token_ids == [IM_USER, HELLO, IM_END, IM_ASSISTANT]
    finally:
        llm.shutdown()


def test_untrusted_custom_config_names_the_flag(custom_config_checkpoint):
    with pytest.raises(ValueError, match="--trust-remote-code") as info:
        LLM(model=str(custom_config_checkpoint), **ENGINE)
    assert "configuration_atom_test.py" in str(info.value)


@pytest.mark.parametrize(
    "split",  # data-parallel: ~90 s on the 2-core CI machine (two engine processes)
    ["tensor_parallel_size", pytest.param("data_parallel_size", marks=pytest.mark.slow)],
)
def test_trusted_custom_config_reaches_every_process(custom_config_checkpoint, split):
    # Rank 1 (a tensor-parallel worker), or each replica (a data-parallel engine process), reads
    # the config in a process of its own: untrusted there, it would fail at start.
    llm = LLM(model=str(custom_config_checkpoint), trust_remote_code=True, **{split: 2}, **ENGINE)
    try:
        assert type(llm.engine.hf_config).__name__ == "AtomTestLlamaConfig"
        assert llm.engine.max_model_len == 2048  # context_k=2, as only its code reads it
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        outs = llm.generate(["hello world", "hello"], params, use_tqdm=False)
        assert [o.prompt_token_ids for o in outs] == [[BOS, HELLO, WORLD], [BOS, HELLO]]
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    finally:
        llm.shutdown()


def _cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "atom_engine.cli.main", *argv],
        stdin=subprocess.DEVNULL,  # nothing can answer a prompt: it must not ask one
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("command", [["generate", "hello world"], ["serve"]])
def test_cli_without_the_flag_prints_one_error(custom_tokenizer_checkpoint, command):
    model = str(custom_tokenizer_checkpoint)
    result = _cli(*command, "--model", model, "--device", "cpu", "--dtype", "float32",
                  "--cpu-kv-cache-space", "0.05")  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert f"atom {command[0]}: error: " in result.stderr
    assert "Traceback" not in result.stderr and "[y/N]" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "--trust-remote-code" in errors[0], result.stderr


def test_cli_with_the_flag_generates(custom_tokenizer_checkpoint):
    model = str(custom_tokenizer_checkpoint)
    # --chat: through the checkpoint's chat template, tokenized by its code
    result = _cli("generate", "hello world", "--chat", "--model", model, "--max-tokens", "2",
                  "--trust-remote-code", "--temperature", "0",
                  "--device", "cpu", "--dtype", "float32", "--cpu-kv-cache-space", "0.05",
                  "--enforce-eager")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
