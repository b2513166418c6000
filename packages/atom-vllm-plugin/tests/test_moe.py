"""MoE architectures inside vLLM: ATOM's Qwen3-MoE, Mixtral and GLM-4-MoE (tiny checkpoints saved by
transformers) give the same greedy tokens as vLLM's own implementations (plugin disabled) and as
transformers, and the plugin run really built ATOM's model class.

The plugin runs in this process; vLLM's own implementation needs a fresh process (vLLM resolves
its plugins once per process): this file run as a script.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 3]
MAX_TOKENS = 8


def make_config(arch: str):
    from transformers import Glm4MoeConfig, MixtralConfig, Qwen3MoeConfig

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
    return MixtralConfig(**common, intermediate_size=32, num_local_experts=8,
                         num_experts_per_tok=2)  # fmt: skip


def generate(model_dir: str) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              block_size=32, seed=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    (inner,) = llm.apply_model(
        lambda m: (
            type(getattr(m, "model", m)).__module__ + "." + type(getattr(m, "model", m)).__name__
        )
    )
    model = llm.apply_model(lambda m: type(m).__module__ + "." + type(m).__name__)[0]
    del llm
    gc.collect()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "model": model, "inner": inner}


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


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "glm4_moe"])
def checkpoint(request, tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp(request.param)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    save_random_checkpoint(make_config(request.param), path, seed=1, tokenizer=tokenizer)
    return request.param, path


def test_moe_greedy_matches_vllm_and_transformers(checkpoint, python_env) -> None:
    arch, path = checkpoint
    atom = generate(str(path))
    assert atom["model"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert atom["inner"].startswith(f"atom_models.models.{arch}.")
    proc = subprocess.run([sys.executable, __file__, str(path)],
                          env=python_env(ATOM_DISABLE_VLLM_PLUGIN="1"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-8000:]
    own = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert own["model"].startswith("vllm.model_executor.models.")
    assert atom["tokens"] == own["tokens"]
    assert atom["tokens"] == transformers_tokens(str(path))


if __name__ == "__main__":
    print(json.dumps(generate(sys.argv[1])))
