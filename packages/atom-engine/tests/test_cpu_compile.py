"""The CPU engine's compiled forward (torch.compile, `atom_engine.cpu_compile`): greedy tokens equal
transformers' (the eager engine's parity tests are in test_greedy_parity.py), and the cases that
stay eager say why.

NOTE: the suite runs CPU engines eagerly (the root conftest sets ATOM_CPU_COMPILE=0); these tests
turn compilation on. Each compiled engine costs ~25 s on the 2-core CI machine with Inductor's
caches warm (about 90 s cold).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import Qwen3Config

from atom_engine import LLM, SamplingParams
from atom_engine.cpu_compile import ENV_VAR, why_not_compiled
from atom_models import set_forward_context
from atom_models.native_host import PagedAttentionMetadata

PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old",
]


@pytest.fixture(scope="module")
def compiled_smollm2():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV_VAR, "1")
        llm = LLM(dtype="float32", device="cpu", max_num_batched_tokens=64, block_size=16)
    yield llm
    llm.shutdown()


@pytest.mark.slow  # the compiled engine: ~100 s to build on 2 cores, then ~16 s
def test_bundled_smollm2_compiled_matches_transformers(
    compiled_smollm2, smollm2_hf, greedy_reference
):
    """Batched decodes (the dynamic-size graph), a decode of one sequence (the graph of one
    token) and chunked prefills mixed with decodes (a 64-token budget)."""
    llm = compiled_smollm2
    assert llm.engine.runner.forward is not llm.engine.runner.model
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [greedy_reference(smollm2_hf, ids, 24, eos) for ids in prompt_ids]
    batch = [{"prompt_token_ids": ids} for ids in prompt_ids]
    outputs = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    (alone,) = llm.generate(batch[:1], params, use_tqdm=False)
    assert alone.outputs[0].token_ids == expected[0]


@pytest.mark.slow  # its first compiled forward at a new step shape: ~120 s on 2 cores
def test_compiled_forward_equals_eager_forward(compiled_smollm2):
    """The compiled graph against the same model run eagerly, on a mixed step (a prefill chunk
    over a cached prefix and two decodes): the same hidden states, within float32 reordering."""
    runner = compiled_smollm2.engine.runner
    block = runner.block_size
    # Three sequences in blocks 0-5 (no request holds them: the engine is idle).
    seq_lens, query_lens = [40, 7, 19], [9, 1, 1]
    tables = [[0, 1, 2], [3], [4, 5]]
    gen = torch.Generator().manual_seed(0)
    md = PagedAttentionMetadata.build(seq_lens, query_lens, tables, block)
    ids = torch.randint(3, 49152, (sum(query_lens),), generator=gen)
    positions = torch.tensor([p for s, q in zip(seq_lens, query_lens, strict=True)
                              for p in range(s - q, s)])  # fmt: skip
    # Fill the prefixes through the eager model first (both runs then read the same cache).
    prefix = PagedAttentionMetadata.build(
        [s - q for s, q in zip(seq_lens, query_lens, strict=True)],
        [s - q for s, q in zip(seq_lens, query_lens, strict=True)], tables, block,
    )  # fmt: skip
    prefix_ids = torch.randint(3, 49152, (sum(seq_lens) - sum(query_lens),), generator=gen)
    prefix_positions = torch.cat([torch.arange(s - q) for s, q in zip(seq_lens, query_lens,
                                                                     strict=True)])  # fmt: skip
    with torch.no_grad():
        with set_forward_context(prefix):
            runner.model(prefix_ids, prefix_positions)
        with set_forward_context(md):
            eager = runner.model(ids, positions)
        with set_forward_context(md):
            compiled = runner.forward(ids, positions)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


def test_what_stays_eager(tiny_checkpoint, monkeypatch):
    config = Qwen3Config(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
    )  # fmt: skip
    path, _ = tiny_checkpoint(config, seed=3)
    monkeypatch.setenv(ENV_VAR, "1")
    llm = LLM(str(path), dtype="float32", device="cpu", enforce_eager=True)
    runner = llm.engine.runner
    assert runner.forward is runner.model
    cpu = torch.device("cpu")
    assert why_not_compiled(runner.model, cpu, True, 1) == "enforce_eager"
    assert why_not_compiled(runner.model, cpu, False, 2).startswith("tensor parallelism")
    assert why_not_compiled(runner.model, cpu, False, 1) is None
    monkeypatch.setenv(ENV_VAR, "0")
    assert why_not_compiled(runner.model, cpu, False, 1) == f"{ENV_VAR}=0"


_IMPORT_CPP_EXTENSION = """
import torch.utils.cpp_extension as ext
print(ext.CUDA_HOME)
"""


def test_no_cuda_runtime_warning_is_filtered():
    # Inductor's C++ builder imports torch.utils.cpp_extension, which warns "No CUDA runtime is
    # found, using CUDA_HOME=..." where a CUDA toolkit is installed and no GPU is visible.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
        )

    quiet = "from atom_engine.cpu_compile import quiet_cuda_home_warning\n"
    quiet += "quiet_cuda_home_warning()\nquiet_cuda_home_warning()\n"
    filtered = run(quiet + _IMPORT_CPP_EXTENSION)
    assert filtered.returncode == 0, filtered.stderr
    assert "No CUDA runtime" not in filtered.stderr
    control = run(_IMPORT_CPP_EXTENSION)  # the warning, where this machine has a toolkit
    toolkit = control.stdout.strip() != "None"
    assert ("No CUDA runtime" in control.stderr) == toolkit, control.stderr
