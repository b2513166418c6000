"""DeepSeek-V3 inside vLLM: ATOM's model on vLLM's multi-head latent attention (`MLAAttention`,
its latent cache, CPU_MLA on the CPU build) gives the same greedy tokens as vLLM's own DeepSeek-V3
implementation (plugin disabled) and as transformers, on a tiny checkpoint saved by transformers
(low-rank q, qk_nope_head_dim != v_head_dim, grouped routing with a correction bias, a shared
expert, a dense first layer, DeepSeek YaRN). vLLM's CPU MLA decode kernel takes DeepSeek's latent
shape only (576 values per token: kv_lora_rank 512 + qk_rope_head_dim 64, block size 16).

Both runs ask for CPU_MLA by name: where the CPU has AMX tiles vLLM 0.32 prefers AMX_MLA, which
packs the absorbed weights in AMX blocks (it refuses this checkpoint's 16-wide qk_nope_head_dim,
"invalid weight input features 16") and is vLLM's bf16 path, not the float32 reference here.

The plugin runs in this process; vLLM's own implementation needs a fresh process (vLLM resolves
its plugins once per process): this file run as a script.
"""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys

PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42] * 3]
MAX_TOKENS = 8


def make_config():
    from transformers import DeepseekV3Config

    # topk_method / scoring_func as DeepSeek-V3's published config.json has them: vLLM's own
    # implementation reads them (transformers' always uses sigmoid with the correction bias).
    return DeepseekV3Config(
        topk_method="noaux_tc", scoring_func="sigmoid", vocab_size=49152, hidden_size=64,
        intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=512, tie_word_embeddings=False, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=24, kv_lora_rank=512,
        qk_nope_head_dim=16, qk_rope_head_dim=64, v_head_dim=24,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8},
    )  # fmt: skip


def generate(model_dir: str) -> dict:
    """Greedy tokens, and the classes vLLM ran (model, inner model, MLA impls by layer)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              block_size=32, seed=0, attention_config={"backend": "CPU_MLA"})  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)

    def name(obj) -> str:
        return type(obj).__module__ + "." + type(obj).__qualname__

    def classes(model) -> dict:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention

        layers = {int(re.search(r"layers\.(\d+)\.", m.layer_name).group(1)): m
                  for m in model.modules() if isinstance(m, MLAAttention)}  # fmt: skip
        return {
            "model": name(model),
            "inner": name(getattr(model, "model", model)),
            "mla_layers": sorted(layers),
            "attention": sorted({name(m.impl) for m in layers.values()}),
        }

    (info,) = llm.apply_model(classes)
    del llm
    gc.collect()
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], **info}


def transformers_tokens(model_dir: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for p in PROMPTS:
            out = hf.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                min_new_tokens=MAX_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
            rows.append(out[0, len(p) :].tolist())
    return rows


def test_deepseek_v3_greedy_matches_vllm_and_transformers(
    tmp_path_factory, smollm2_dir, python_env
) -> None:
    from transformers import AutoTokenizer

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("deepseek_v3")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    save_random_checkpoint(make_config(), path, seed=1, tokenizer=tokenizer)

    atom = generate(str(path))
    assert atom["model"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert atom["inner"] == "atom_models.models.deepseek_v3.DeepseekV3ForCausalLM"
    assert atom["mla_layers"] == [0, 1]
    proc = subprocess.run([sys.executable, __file__, str(path)],
                          env=python_env(ATOM_DISABLE_VLLM_PLUGIN="1"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-8000:]
    own = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert own["model"].startswith("vllm.model_executor.models.deepseek")
    assert atom["attention"] == own["attention"]  # the same vLLM MLA backend
    assert atom["attention"] == ["vllm.v1.attention.backends.mla.cpu_mla.CPUMLAImpl"]
    assert atom["tokens"] == transformers_tokens(str(path))
    assert own["tokens"] == atom["tokens"]


if __name__ == "__main__":
    print(json.dumps(generate(sys.argv[1])))
