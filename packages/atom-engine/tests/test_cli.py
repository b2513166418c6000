"""The `atom` command: flags generated from EngineConfig, subcommands, and real runs."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from atom_engine import EngineConfig
from atom_engine.cli.args import FLAG_GROUPS, engine_config_from_args
from atom_engine.cli.main import build_parser, main

ATOM = str(Path(sys.executable).parent / "atom")  # the [project.scripts] entry point


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def test_serve_help_lists_every_engine_flag():
    result = subprocess.run([ATOM, "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for field in dataclasses.fields(EngineConfig):
        assert _flag(field.name) in result.stdout, field.name
        assert field.metadata["help"].split()[0] in result.stdout
    for flag in ("--no-enable-prefix-caching", "--port", "--api-key", "--served-model-name",
                 "--profiler-dir", "--uvicorn-log-level"):  # fmt: skip
        assert flag in result.stdout


def test_engine_flags_round_trip():
    parser = build_parser()
    defaults = engine_config_from_args(parser.parse_args(["serve"]))
    assert defaults == EngineConfig()
    args = parser.parse_args(
        ["serve", "--max-model-len", "256", "--no-enable-prefix-caching", "--dtype", "float32",
         "--cpu-kv-cache-space", "0.5", "--enforce-eager", "--port", "9000"]
    )  # fmt: skip
    config = engine_config_from_args(args)
    assert config.max_model_len == 256 and config.enable_prefix_caching is False
    assert config.dtype == "float32" and config.cpu_kv_cache_space == 0.5
    assert config.enforce_eager is True and args.port == 9000 and args.host == "127.0.0.1"
    # vLLM's short forms of the parallel sizes
    args = parser.parse_args(["serve", "-tp", "2", "-dp", "3", "--enable-expert-parallel"])
    config = engine_config_from_args(args)
    assert (config.tensor_parallel_size, config.data_parallel_size) == (2, 3)
    assert config.enable_expert_parallel is True


def test_invalid_engine_flag_is_an_error(capsys):
    assert main(["generate", "hi", "--block-size", "3"]) == 2
    assert "block_size must be a power of two" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "--max-model-len", "many"])


def test_convert_is_delegated(capsys):
    with pytest.raises(SystemExit) as info:
        main(["convert", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "gguf_path" in out and "out_dir" in out


def test_bench_hook():
    choices = build_parser()._subparsers._group_actions[0].choices
    assert {"serve", "generate", "chat", "convert"} <= choices.keys()
    has_bench = importlib.util.find_spec("atom_engine.bench.cli") is not None
    assert ("bench" in choices) == has_bench


def test_generate_prints_the_completion():
    # Loads the bundled model in a new process (~20-40 s on a 2-core CPU).
    result = subprocess.run(
        [ATOM, "generate", "The capital of France is", "--max-tokens", "4", "--dtype", "float32",
         "--device", "cpu", "--cpu-kv-cache-space", "0.25"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(" Paris"), result.stdout


@pytest.mark.slow
def test_chat_keeps_history():
    turns = "What is the capital of France?\n/reset\nAnd of Germany?\n/exit\nnot read\n"
    result = subprocess.run(
        [ATOM, "chat", "--max-tokens", "8", "--dtype", "float32", "--device", "cpu",
         "--cpu-kv-cache-space", "0.25"],
        input=turns, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    replies = result.stdout.strip().splitlines()
    assert len(replies) == 2 and "Paris" in replies[0], result.stdout


def _torch_warnings(stderr: str) -> list[str]:
    """Lines of torch's own log format ("W1127 13:45:06.445000 2932 file.py:183] ...") and the
    one line the CUDA toolkit check logs."""
    return [
        line
        for line in stderr.splitlines()
        if re.match(r"[WE]\d{4} \d", line) or "No CUDA runtime is found" in line
    ]


def test_chat_help_prints_no_warning():
    result = subprocess.run(
        [sys.executable, "-m", "atom_engine.cli.main", "chat", "--help"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0 and "--trust-remote-code" in result.stdout
    assert result.stderr == ""


@pytest.mark.slow
def test_compiled_chat_prints_no_library_warning():
    # The CPU forward compiled (Inductor imports torch.utils.cpp_extension, which warned "No CUDA
    # runtime is found, using CUDA_HOME=..." on a machine with nvcc and no GPU): minutes on a
    # busy 2-core machine.
    result = subprocess.run(
        [sys.executable, "-m", "atom_engine.cli.main", "chat", "--max-tokens", "2",
         "--device", "cpu", "--cpu-kv-cache-space", "0.25"],
        input="Hi\n", capture_output=True, text=True, timeout=900,
        env={**os.environ, "ATOM_CPU_COMPILE": "1", "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), result.stderr
    assert _torch_warnings(result.stderr) == [], result.stderr


def test_serve_help_groups_flags_as_vllm_does():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    titles = ["frontend:", "model:", "load:", "device:", "cache:", "scheduler:", "compilation:",
              "parallel:", "speculative decoding:"]  # fmt: skip
    at = [help_text.find("\n" + title + "\n") for title in titles]
    assert -1 not in at and at == sorted(at), help_text
    model = help_text[at[1] : at[2]]
    assert "--trust-remote-code, --no-trust-remote-code" in model and "--max-model-len" in model
    assert "--dtype {auto,float32,bfloat16,float16}" in help_text  # choices, as vLLM lists them
    assert "--port PORT           port to listen on (default: 8000)" in help_text
    named = {name for _, _, names in FLAG_GROUPS for name in names}
    assert named <= set(EngineConfig.field_names())
    for field in dataclasses.fields(EngineConfig):  # one line each, not a paragraph
        assert len(field.metadata["help"]) <= 100, field.name
