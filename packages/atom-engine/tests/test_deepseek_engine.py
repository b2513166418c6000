"""DeepSeek-V3 / Kimi-K2 through the engine (MLA over the paged latent cache): greedy generation
equals transformers' token for token (float32, CPU), batched with chunked prefill, prefix-cache
hits, preemption and async scheduling; the cache is sized from the latent's bytes per token; and
`atom serve --model <dir>` answers a chat completion."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config

from atom_engine import LLM, SamplingParams
from atom_engine.chat_template import apply_chat_template

ATOM = str(Path(sys.executable).parent / "atom")  # the [project.scripts] entry point

BASE = dict(
    vocab_size=49152,  # the bundled tokenizer's, saved beside the weights
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    n_routed_experts=8,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    first_k_dense_replace=1,
)

DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}

CONFIGS = {
    # DeepSeek-V3's shape: low-rank q, Dn != Dv, 4 groups (best 2), shared expert, YaRN.
    "v3": lambda: DeepseekV3Config(
        **BASE,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=24,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        rope_parameters=DEEPSEEK_YARN,
    ),
    # Kimi-K2's routing: one group; plain q_proj.
    "kimi": lambda: DeepseekV3Config(
        **BASE,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
    ),
    # 2 groups, 1 kept; Dn < Dv; non-interleaved rope; two shared experts.
    "groups-2-1": lambda: DeepseekV3Config(
        **BASE,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        v_head_dim=20,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        rope_interleave=False,
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


@pytest.fixture(scope="module")
def deepseek(tiny_checkpoint, greedy_reference):
    """deepseek(name) -> (checkpoint directory, prompts, transformers' greedy tokens), built once
    per configuration."""
    built = {}

    def get(name: str):
        if name not in built:
            path, hf = tiny_checkpoint(CONFIGS[name](), seed=13)
            prompts = prompt_ids()
            expected = [greedy_reference(hf, p, MAX_TOKENS, None) for p in prompts]
            built[name] = path, prompts, expected
        return built[name]

    return get


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_matches_transformers_with_prefix_caching(deepseek, name, caplog):
    path, prompts, expected = deepseek(name)
    # A token budget below the batch's prompt tokens: chunked prefills share steps with decodes.
    with caplog.at_level(logging.INFO, logger="atom_engine"):
        llm = LLM(
            str(path),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_blocks=256,
            max_num_batched_tokens=40,
        )
    # The latent cache: (kv_lora_rank + qk_rope_head_dim) fp32 values per token and layer.
    per_token = 2 * (32 + 8) * 4
    assert f"1024 tokens fit, {per_token} bytes per token" in caplog.text
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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_matches_transformers_under_preemption(deepseek, async_scheduling):
    """A cache of 24 blocks x 4 tokens for 7 sequences of up to 57 tokens: preemption by
    recompute, with plain and with async scheduling."""
    path, prompts, expected = deepseek("v3")
    llm = LLM(
        str(path),
        dtype="float32",
        device="cpu",
        block_size=4,
        num_kv_blocks=24,
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_gpu_greedy_matches_transformers(name, tmp_path, greedy_reference):
    """On a GPU (float32, CUDA graphs, the Triton MLA kernels: absorbed decode in the graphs,
    expanded prefill over paged attention): the same tokens as transformers on the CPU."""
    from atom_models.testing import save_random_checkpoint

    hf = save_random_checkpoint(CONFIGS[name](), tmp_path, seed=13)  # no tokenizer: ids only
    gen = torch.Generator().manual_seed(7)
    prompts = prompt_ids() + [torch.randint(3, 49152, (200,), generator=gen).tolist()]
    expected = [greedy_reference(hf, p, MAX_TOKENS, None) for p in prompts]
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        device="cuda",
        skip_tokenizer_init=True,
        block_size=16,
        num_kv_blocks=256,
        cudagraph_mode="full",  # MLA reads host lengths: the prefills keep the piecewise graphs
    )
    assert llm.engine.runner.graphs is not None and llm.engine.runner.graphs.mixed is None
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected, name
    assert llm.engine.runner.graphs.pieces.replays > 0  # the prefills ran as piecewise graphs
    # Again: the prefix cache serves every prompt's full blocks.
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected, name


@pytest.mark.gpu
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_gpu_flashinfer_mla_decode_agrees_with_atoms(eager, tmp_path, monkeypatch):
    """`ATOM_FLASHINFER=mla_decode` (FlashInfer installed): the decode steps of 20 sequences take
    FlashInfer's planned MLA (DeepSeek-V3's latent 512 + rope 64, bf16), in the captured graphs
    or eagerly, and give the log-probs ATOM's kernel gives. Three decode steps: the first reads
    a cache both runs wrote alike (the prefill is ATOM's in both); later ones also read what the
    earlier steps wrote, so bf16 differences add up (over ten steps this random model's flat
    logits let a sequence take another token). Every log-prob both runs report (each run's top
    20) within 0.15 nats (bf16 logits of magnitude 4-8 step by 0.0625), up to a sequence's first
    differing token, where FlashInfer's is among ATOM's top 20."""
    pytest.importorskip("flashinfer")
    from atom_models.testing import save_random_checkpoint

    config = CONFIGS["v3"]()
    config.kv_lora_rank, config.qk_rope_head_dim = 512, 64
    save_random_checkpoint(config, tmp_path, seed=13)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in range(5, 105, 5)]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=20)
    runs = {}
    for setting in ("0", "mla_decode"):
        monkeypatch.setenv("ATOM_FLASHINFER", setting)
        llm = LLM(
            str(tmp_path), dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
            block_size=16, num_kv_blocks=512, max_num_seqs=32, enforce_eager=eager,
        )  # fmt: skip
        runner = llm.engine.runner
        planned = runner._mla_eager if eager else (runner.graphs.decode.mla or {}).get(32)
        assert (planned is not None) == (setting == "mla_decode")
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[setting] = [o.outputs[0] for o in outs]
        if planned is not None:
            assert planned.plans >= 3  # every decode step of the 20 sequences
        llm.shutdown()
    compared = 0
    for atom, fi in zip(runs["0"], runs["mla_decode"], strict=True):
        assert atom.token_ids[0] == fi.token_ids[0]  # the prefill: the same kernels
        for j in range(1, len(atom.token_ids)):
            top_atom, top_fi = atom.logprobs[j], fi.logprobs[j]
            for token in top_atom.keys() & top_fi.keys():
                delta = abs(top_atom[token].logprob - top_fi[token].logprob)
                assert delta < 0.15, (j, token, top_atom[token], top_fi[token])
                compared += 1
            a, b = atom.token_ids[j], fi.token_ids[j]
            if a != b:
                assert b in top_atom, f"step {j}: FlashInfer's token {b} is not in ATOM's top 20"
                break
    assert compared >= 200


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


def test_atom_serve_answers_a_chat_completion(tiny_checkpoint, bundled_tokenizer, greedy_reference):
    path, hf = tiny_checkpoint(CONFIGS["v3"](), seed=17)
    messages = [{"role": "user", "content": "Name three primary colors."}]
    prompt = apply_chat_template(bundled_tokenizer, messages)
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
            f"{url}/v1/chat/completions",
            {"model": str(path), "messages": messages, "max_tokens": 8, "temperature": 0},
        )
        assert status == 200, out
        (choice,) = out["choices"]
        text = bundled_tokenizer.decode(expected, skip_special_tokens=True)
        assert choice["message"]["content"] == text
        assert out["usage"]["prompt_tokens"] == len(prompt)
        assert out["usage"]["completion_tokens"] == len(expected)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
