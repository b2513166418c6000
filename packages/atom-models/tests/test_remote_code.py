"""When a checkpoint's own code is needed (`atom_models.remote_code`): config.json's and
tokenizer_config.json's `auto_map`, against the classes `transformers` has itself."""

from __future__ import annotations

import json

import pytest

from atom_models.remote_code import RemoteCodeError, check_config_code, check_tokenizer_code

KIMI = ["tokenization_kimi.TikTokenTokenizer", None]


def _write(path, name: str, data: dict) -> dict:
    (path / name).write_text(json.dumps(data))
    return data


@pytest.mark.parametrize(
    "tokenizer_config",
    [
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": KIMI}},
        {"auto_map": {"AutoTokenizer": KIMI}},  # no class named: only the code says
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": KIMI},  # the old list form
        {"tokenizer_class": "X", "auto_map": {"AutoTokenizer": [None, "org--repo--tok.XFast"]}},
    ],
)
def test_custom_tokenizer_code_needs_trust(tmp_path, tokenizer_config):
    _write(tmp_path, "tokenizer_config.json", tokenizer_config)
    with pytest.raises(RemoteCodeError, match="pass --trust-remote-code") as info:
        check_tokenizer_code(tmp_path, trust_remote_code=False)
    assert isinstance(info.value, ValueError)  # the CLI prints ValueErrors as one line
    assert "tokenizer with its own code (tok" in str(info.value)
    check_tokenizer_code(tmp_path, trust_remote_code=True)


@pytest.mark.parametrize(
    "tokenizer_config",
    [
        {"tokenizer_class": "Qwen2Tokenizer"},
        # Code shipped beside a class transformers has: transformers loads its own, untrusted.
        {"tokenizer_class": "Qwen2TokenizerFast", "auto_map": {"AutoTokenizer": KIMI}},
    ],
)
def test_tokenizers_transformers_has_need_no_trust(tmp_path, tokenizer_config):
    _write(tmp_path, "tokenizer_config.json", tokenizer_config)
    check_tokenizer_code(tmp_path, trust_remote_code=False)


def test_no_tokenizer_config_needs_no_trust(tmp_path):
    check_tokenizer_code(tmp_path, trust_remote_code=False)


def test_custom_config_code_needs_trust_only_for_unknown_model_types(tmp_path):
    auto_map = {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}
    known = _write(tmp_path, "config.json", {"model_type": "llama", "auto_map": auto_map})
    check_config_code(tmp_path, known, trust_remote_code=False)  # LlamaConfig, as transformers
    unknown = _write(tmp_path, "config.json", {"model_type": "my_llama", "auto_map": auto_map})
    with pytest.raises(RemoteCodeError, match="configuration with its own code"):
        check_config_code(tmp_path, unknown, trust_remote_code=False)
    check_config_code(tmp_path, unknown, trust_remote_code=True)
