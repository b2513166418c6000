"""Tensor-parallel shard math on CPU: two real ranks over a gloo process group."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from atom_models import load_model

WORKER = Path(__file__).with_name("tp_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "config",
    [
        # 2 KV heads split one per rank; vocab 211 is not divisible by 2 (padded LM head shard).
        LlamaConfig(
            vocab_size=211,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
        # 1 KV head replicated on both ranks; tied embeddings; Qwen3 q/k norms.
        Qwen3Config(
            vocab_size=211,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            tie_word_embeddings=True,
        ),
    ],
    ids=["llama-kv-split", "qwen3-kv-replicated"],
)
def test_tp2_matches_tp1(config, make_checkpoint, paged_session, tmp_path):
    path, _ = make_checkpoint(config)
    gen = torch.Generator().manual_seed(3)
    batch = [torch.randint(0, 211, (n,), generator=gen).tolist() for n in (9, 4, 15)]
    torch.save(batch, tmp_path / "prompts.pt")
    out = paged_session(load_model(path)).step(dict(enumerate(batch)))
    expected = torch.cat([out[i] for i in range(len(batch))])

    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                "--rank",
                str(rank),
                "--world-size",
                "2",
                "--port",
                str(port),
                "--checkpoint",
                str(path),
                "--prompts",
                str(tmp_path / "prompts.pt"),
                "--out",
                str(tmp_path / f"rank{rank}.pt"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    for rank, proc in enumerate(procs):
        output, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"rank {rank} failed:\n{output}"
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
