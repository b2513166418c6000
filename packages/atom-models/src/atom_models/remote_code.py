"""A checkpoint's own Python code (`auto_map` in its config.json / tokenizer_config.json): run
only when the user trusts it (`--trust-remote-code`, `trust_remote_code=True`), as `transformers`
runs it.

Every config and tokenizer load passes `trust_remote_code` to `transformers` as an explicit bool:
left None, `transformers` asks "Do you wish to run the custom code? [y/N]" on stdin and waits (a
server would hang). Checked here first, so that a checkpoint that needs its code and lacks the
user's trust fails with one message naming the flag instead of a `transformers` error.
"""

from __future__ import annotations

import json
from pathlib import Path

TRUST_FLAG = "--trust-remote-code"


class RemoteCodeError(ValueError):
    """The checkpoint needs its own code and `trust_remote_code` is off."""


def _auto_map_ref(path: Path, file: str, auto_class: str) -> str | None:
    """The `auto_map` entry of `auto_class` in `path/file` ("module.Class"), or None. A
    tokenizer's entry is [slow, fast] (or, in old checkpoints, the whole auto_map is that list):
    the fast one when given, as `transformers` picks."""
    try:
        data = json.loads((path / file).read_text())
    except (OSError, ValueError):
        return None
    auto_map = data.get("auto_map") if isinstance(data, dict) else None
    if isinstance(auto_map, dict):
        ref = auto_map.get(auto_class)
    elif isinstance(auto_map, list | tuple) and auto_class == "AutoTokenizer":
        ref = auto_map
    else:
        return None
    if isinstance(ref, list | tuple):
        ref = next((r for r in reversed(ref) if r), None)
    return ref if isinstance(ref, str) and ref else None


def _refuse(path: Path, what: str, ref: str) -> RemoteCodeError:
    module, _, cls = ref.split("--")[-1].rpartition(".")
    return RemoteCodeError(
        f"{path} loads its {what} with its own code ({module}.py, class {cls}); ATOM runs a "
        f"checkpoint's code only when asked: pass {TRUST_FLAG} (LLM(trust_remote_code=True)) "
        "if you trust it"
    )


def check_config_code(path: Path, config_dict: dict, trust_remote_code: bool) -> None:
    """Raise RemoteCodeError when config.json's configuration class is the checkpoint's own code,
    `transformers` has none of that model_type, and the code is not trusted. (With a model_type
    `transformers` knows, it loads its own class untrusted, and so does ATOM.)"""
    ref = _auto_map_ref(path, "config.json", "AutoConfig")
    if ref is None or trust_remote_code:
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config_dict.get("model_type") not in CONFIG_MAPPING:
        raise _refuse(path, "configuration", ref)


def check_tokenizer_code(path: Path, trust_remote_code: bool) -> None:
    """Raise RemoteCodeError when tokenizer_config.json maps AutoTokenizer to the checkpoint's
    own code, its `tokenizer_class` is none of `transformers`' own, and the code is not trusted.

    `transformers` itself would not always refuse: with a config type it knows (a Llama-shaped
    checkpoint), an unknown `tokenizer_class` falls back to a generic tokenizer built from
    whatever files are there, silently not the checkpoint's tokenizer."""
    ref = _auto_map_ref(path, "tokenizer_config.json", "AutoTokenizer")
    if ref is None or trust_remote_code:
        return
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    if name:
        base = name.removesuffix("Fast")
        cls = tokenizer_class_from_name(base) or tokenizer_class_from_name(base + "Fast")
        # A class a trusted load ran earlier in this process is still the checkpoint's code.
        if cls is not None and not cls.__module__.startswith("transformers_modules"):
            return
    raise _refuse(path, "tokenizer", ref)
