"""The MoE architectures through the engine: greedy generation equals transformers' token for
token (float32, CPU), batched with chunked prefill and prefix caching; and `atom serve --model
<dir>` answers a completion from an MoE checkpoint."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import Glm4MoeConfig, GptOssConfig, MixtralConfig, Qwen3MoeConfig

from atom_engine import LLM, SamplingParams

ATOM = str(Path(sys.executable).parent / "atom")  # the [project.scripts] entry point

BASE = dict(
    vocab_size=49152,  # the bundled tokenizer's, saved beside the weights
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **BASE,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),
    "mixtral": lambda: MixtralConfig(
        **BASE, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=24
    ),
    "glm4_moe": lambda: Glm4MoeConfig(
        **BASE,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        use_qk_norm=True,
        attention_bias=True,
    ),
    "gpt_oss": lambda: GptOssConfig(
        **BASE,
        head_dim=16,
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=8,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    ),
}
MAX_TOKENS = 12


def prompt_ids(seed: int = 5) -> list[list[int]]:
    """Prompts of mixed lengths; the last two extend the third's first 16 tokens."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (1, 9, 30, 45, 17)]
    for extra in (3, 11):
        prompts.append(prompts[2][:16] + torch.randint(3, 49152, (extra,), generator=gen).tolist())
    return prompts


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def moe(request, tiny_checkpoint):
    path, hf = tiny_checkpoint(CONFIGS[request.param](), seed=13)
    return request.param, path, hf


def test_greedy_matches_transformers_with_prefix_caching(moe, greedy_reference):
    name, path, hf = moe
    prompts = prompt_ids()
    expected = [greedy_reference(hf, p, MAX_TOKENS, None) for p in prompts]
    # A token budget below the batch's prompt tokens: chunked prefills share steps with decodes.
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=40,
    )
    assert llm.engine.config.enable_prefix_caching
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    first = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected, name

    # Again: every prompt's full blocks now come from the prefix cache.
    hits_before = llm.engine.block_manager.num_hit_tokens
    second = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == expected, name
    hits = llm.engine.block_manager.num_hit_tokens - hits_before
    assert hits == sum((len(p) - 1) // 4 * 4 for p in prompts)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full_and_piecewise", "full"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpu_greedy_matches_transformers(name, mode, tmp_path, greedy_reference):
    """On a GPU (float32, CUDA graphs: the prefills piecewise, or whole-forward with `full`):
    the same tokens as transformers on the CPU. Two long prompts put ~150 pairs on each expert in
    the first step, so the Triton fused MoE's prefill configuration runs (TMA weight loads on
    Hopper), beside the decode and mid-size ones."""
    from atom_models.testing import save_random_checkpoint

    hf = save_random_checkpoint(CONFIGS[name](), tmp_path, seed=13)  # no tokenizer: ids only
    gen = torch.Generator().manual_seed(7)
    prompts = prompt_ids() + [
        torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (200, 240)
    ]
    expected = [greedy_reference(hf, p, MAX_TOKENS, None) for p in prompts]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        device="cuda",
        skip_tokenizer_init=True,
        block_size=16,
        num_kv_blocks=256,
        cudagraph_mode=mode,
    )
    runner = llm.engine.runner
    assert runner.graphs is not None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected, name
    graphs = runner.graphs.pieces if mode == "full_and_piecewise" else runner.graphs.mixed
    assert graphs.replays > 0  # the prefills ran as piecewise (or whole-forward) graphs


# -- atom serve --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _request(url: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        text = r.read().decode()
        return r.status, json.loads(text) if text.startswith("{") else text


def test_atom_serve_answers_a_completion(tiny_checkpoint, bundled_tokenizer, greedy_reference):
    path, hf = tiny_checkpoint(CONFIGS["gpt_oss"](), seed=17)
    prompt = prompt_ids(seed=9)[3]
    expected = greedy_reference(hf, prompt, 8, bundled_tokenizer.eos_token_id)
    port = _free_port()
    server = subprocess.Popen(
        [
            ATOM,
            "serve",
            "--model",
            str(path),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--device",
            "cpu",
            "--num-kv-blocks",
            "64",
            "--block-size",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, f"atom serve exited:\n{server.communicate()[0]}"
            assert time.monotonic() < deadline, "atom serve did not come up"
            try:
                if _request(f"{url}/health")[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.5)
        status, out = _request(
            f"{url}/v1/completions",
            {"model": str(path), "prompt": prompt, "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, out
        (choice,) = out["choices"]
        assert choice["text"] == bundled_tokenizer.decode(expected, skip_special_tokens=True)
        assert out["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(expected),
            "total_tokens": len(prompt) + len(expected),
        }
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
