"""Start-up: a progress bar per phase on stderr (off with show_progress=False), one log line of
the phases' seconds, and the load formats the engine accepts."""

from __future__ import annotations

import logging

import pytest
from transformers import Qwen3Config

from atom_engine import LLM, EngineConfig
from atom_engine.cli.args import CHOICES
from atom_models.testing import save_random_checkpoint
from atom_models.weights import safetensors_files


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-sharded")
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    save_random_checkpoint(config, path, max_shard_size="64KB")
    assert len(safetensors_files(path)) >= 3
    return path


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", skip_tokenizer_init=True, num_kv_blocks=8, **kwargs)


def test_bars_and_phase_times(sharded, capfd, caplog):
    """At TP=2 (rank 0's bars and line): the workers' start is a phase of its own."""
    shards = len(safetensors_files(sharded))
    with caplog.at_level(logging.INFO, logger="atom_engine"):
        llm = _llm(sharded, load_format="safetensors", tensor_parallel_size=2)
    err = capfd.readouterr().err
    assert "Loading safetensors checkpoint shards" in err and f"{shards}/{shards}" in err
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("startup ")]
    assert ": front " in line and ", workers " in line, line
    assert ", load " in line and ", kv-cache " in line, line
    llm.shutdown()


def test_no_bars_with_the_switch(sharded, capfd):
    llm = _llm(sharded, show_progress=False)
    assert "Loading safetensors" not in capfd.readouterr().err
    llm.shutdown()


def test_load_format_choices():
    assert CHOICES["load_format"] == ("auto", "safetensors", "fastsafetensors", "gguf", "dummy")
    with pytest.raises(ValueError, match="^load_format must be one of auto, safetensors, "):
        EngineConfig(load_format="pt")
    EngineConfig(load_format="safetensors")


@pytest.mark.gpu
def test_graph_capture_bars_leave_outputs_unchanged(sharded, capfd, caplog):
    """A bar per graph family over its capture sizes; with the bars off the same graphs give the
    same greedy tokens."""
    from atom_engine import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3, 4 + i]} for i in range(3)]
    outputs = []
    for show in (True, False):
        with caplog.at_level(logging.INFO, logger="atom_engine"):
            llm = LLM(
                str(sharded),
                device="cuda",
                skip_tokenizer_init=True,
                num_kv_blocks=64,
                max_num_seqs=4,
                max_num_batched_tokens=64,
                show_progress=show,
            )
        err = capfd.readouterr().err
        assert ("Capturing CUDA graphs (decode)" in err) is show, err
        outs = llm.generate(prompts, params, use_tqdm=False)
        outputs.append([o.outputs[0].token_ids for o in outs])
        llm.shutdown()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("startup ")]
    assert len(lines) == 2 and ", graphs " in lines[0], lines
    assert outputs[0] == outputs[1]
