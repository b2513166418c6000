"""MoE architectures inside vLLM: ATOM's Qwen3-MoE, Mixtral, GLM-4-MoE and GPT-OSS (tiny checkpoints
saved by transformers) give the same greedy tokens as vLLM's own implementations (plugin disabled)
and as transformers, and the plugin run really built ATOM's model class on ATOM's attention.

GPT-OSS also checks what reaches vLLM's attention layers: the checkpoint's per-head sinks (after
weight loading) and the sliding window of every other layer, on ATOM's backend and, with
ATOM_DISABLE_VLLM_PLUGIN_ATTENTION=1, on vLLM's own CPU backend.

The plugin runs in this process; vLLM's own implementation needs a fresh process (vLLM resolves
its plugins once per process): this file run as a script, once for all four checkpoints.
"""

from __future__ import annotations

import functools
import gc
import json
import re
import subprocess
import sys

import pytest

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 3]
MAX_TOKENS = 8


def make_config(arch: str):
    from transformers import Glm4MoeConfig, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
                  tie_word_embeddings=False)  # fmt: skip
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True,
        )  # fmt: skip
    if arch == "glm4_moe":
        return Glm4MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8,
            num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=1, routed_scaling_factor=2.0,
        )  # fmt: skip
    if arch == "gpt_oss":
        # bf16-style experts (no quantization_config: not MXFP4); layer 0 slides over 8 tokens,
        # less than one 32-token block, so the 40-token prompt also attends past freed blocks.
        return GptOssConfig(
            **common, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
            sliding_window=8,
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 64},
        )  # fmt: skip
    return MixtralConfig(**common, intermediate_size=32, num_local_experts=8,
                         num_experts_per_tok=2)  # fmt: skip


def generate(model_dir: str) -> dict:
    """Greedy tokens, the classes vLLM ran, and what each attention layer holds, by layer index:
    its sliding window and its sinks (None without)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              block_size=32, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)

    def name(obj) -> str:
        return type(obj).__module__ + "." + type(obj).__qualname__

    def classes(model) -> dict:
        from vllm.model_executor.layers.attention import Attention

        by_index = {int(re.search(r"layers\.(\d+)\.", m.layer_name).group(1)): m
                    for m in model.modules() if isinstance(m, Attention)}  # fmt: skip
        layers = [by_index[i] for i in sorted(by_index)]
        sinks = [getattr(m.impl, "sinks", None) for m in layers]
        return {
            "model": name(model),
            "inner": name(getattr(model, "model", model)),
            "attention": sorted({name(m.impl) for m in layers}),
            "windows": [m.sliding_window for m in layers],
            "sinks": [None if t is None else t.tolist() for t in sinks],
        }

    (info,) = llm.apply_model(classes)
    del llm
    gc.collect()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], **info}


def run_in_child(model_dirs, python_env, **switches) -> dict:
    """Model directory -> `generate` of it, all in one fresh process (one import of vLLM)."""
    proc = subprocess.run([sys.executable, __file__, *map(str, model_dirs)],
                          env=python_env(**switches), capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-8000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@functools.cache
def transformers_tokens(model_dir: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for p in PROMPTS:
            mask = torch.ones(1, len(p), dtype=torch.long)
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=mask,
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            rows.append(out[0, len(p) :].tolist())
    return rows


def save_checkpoint(arch: str, tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp(arch)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    save_random_checkpoint(make_config(arch), path, seed=1, tokenizer=tokenizer)
    return path


ARCHS = ["qwen3_moe", "mixtral", "glm4_moe", "gpt_oss"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, smollm2_dir) -> dict:
    return {arch: save_checkpoint(arch, tmp_path_factory, smollm2_dir) for arch in ARCHS}


@pytest.fixture(scope="module")
def own_runs(checkpoints, python_env) -> dict:
    """Arch -> vLLM's own implementation's run (plugin disabled), all in one fresh process."""
    runs = run_in_child(checkpoints.values(), python_env, ATOM_DISABLE_VLLM_PLUGIN="1")
    return {arch: runs[str(path)] for arch, path in checkpoints.items()}


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, checkpoints):
    return request.param, checkpoints[request.param]


ATOM_IMPL = "atom_vllm_plugin.attention.backend.AtomAttentionImpl"
VLLM_CPU_IMPL = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"


def test_moe_greedy_matches_vllm_and_transformers(checkpoint, own_runs) -> None:
    arch, path = checkpoint
    atom = generate(str(path))
    assert atom["model"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert atom["inner"].startswith(f"atom_models.models.{arch}.")
    assert atom["attention"] == [ATOM_IMPL]
    # vLLM's CPU build runs its own implementation of all four, GptOssForCausalLM included
    # (unquantized experts; CPU_ATTN computes sinks and sliding windows).
    own = own_runs[arch]
    assert own["model"].startswith(f"vllm.model_executor.models.{arch}.")
    assert own["attention"] == [VLLM_CPU_IMPL]
    assert atom["tokens"] == own["tokens"]
    assert atom["tokens"] == transformers_tokens(str(path))
    if arch == "gpt_oss":
        assert_gpt_oss_attention(atom, path)
        assert_gpt_oss_attention(own, path)


def test_gpt_oss_atom_model_on_vllms_attention(checkpoints, python_env) -> None:
    """ATOM's GPT-OSS on vLLM's own CPU attention: the sinks reach vLLM's backend too."""
    path = checkpoints["gpt_oss"]
    (mixed,) = run_in_child([path], python_env, ATOM_DISABLE_VLLM_PLUGIN_ATTENTION="1").values()
    assert mixed["model"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert mixed["inner"] == "atom_models.models.gpt_oss.GptOssForCausalLM"
    assert mixed["attention"] == [VLLM_CPU_IMPL]
    assert_gpt_oss_attention(mixed, path)
    assert mixed["tokens"] == transformers_tokens(str(path))


def assert_gpt_oss_attention(run: dict, path) -> None:
    """Layer 0 slides over 8 tokens, layer 1 attends to everything; every layer's backend holds
    the checkpoint's sinks (exact values: they were loaded after the layer was built)."""
    from safetensors.torch import load_file

    tensors = load_file(str(path / "model.safetensors"))
    expected = [tensors[f"model.layers.{i}.self_attn.sinks"].tolist() for i in range(2)]
    assert run["windows"] == [8, None]
    assert run["sinks"] == expected
    assert all(any(v != 0.0 for v in row) for row in expected)


if __name__ == "__main__":
    print(json.dumps({path: generate(path) for path in sys.argv[1:]}))
