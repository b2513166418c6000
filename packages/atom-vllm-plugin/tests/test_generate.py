"""`vllm.LLM` on the bundled SmolLM2 (converted to an HF directory): the same greedy tokens with
ATOM's model and attention, with vLLM's own implementation (plugin disabled), with ATOM's model on
vLLM's attention, and from `transformers`, for a batch of prompts and a second batch that reuses
the first one's cached prefixes.

The plugin run happens in this process, so the counters ATOM's wrapper and attention impl keep
can be read back: the run really went through ATOM. The other two vLLM runs need a fresh process
each (vLLM resolves its platform and plugins once per process): this file run as a script.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

# A shared long prefix (> one 32-token block) makes the second batch hit vLLM's prefix cache, so
# ATOM's attention also runs chunks over cached prefixes, not only fresh prefills and decodes.
STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a "
    "notebook and a tin of oil. From the top he could see the harbour, the fishing boats and the "
    "long grey line of the cliffs."
)
BATCHES = [
    [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time",
        STORY + " One night he saw",
        "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
    ],
    [STORY + " The next morning", STORY + " Years later, the keeper"],
]
MAX_TOKENS = 16
BLOCK_SIZE = 32


def generate(model_dir: str) -> dict:
    """Greedy tokens of every batch, and which model and attention classes vLLM ran."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              block_size=BLOCK_SIZE, enable_prefix_caching=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(b, params)] for b in BATCHES]
    cached = sum(o.num_cached_tokens or 0 for o in llm.generate(BATCHES[1], params))

    def classes(model) -> dict:
        from vllm.model_executor.layers.attention import Attention

        inner = getattr(model, "model", None)
        impls = {type(m.impl).__module__ + "." + type(m.impl).__qualname__
                 for m in model.modules() if isinstance(m, Attention)}  # fmt: skip
        return {
            "model": type(model).__module__ + "." + type(model).__qualname__,
            "inner": type(inner).__module__ + "." + type(inner).__qualname__,
            "attention": sorted(impls),
        }

    (info,) = llm.apply_model(classes)
    del llm
    gc.collect()
    return {"tokens": tokens, "cached_tokens": cached, **info}


def transformers_tokens(model_dir: str) -> list[list[list[int]]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for batch in BATCHES:
        rows = []
        for prompt in batch:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            # Plain greedy with a KV cache, never stopping at EOS (as vLLM's ignore_eos).
            new, past = [], None
            with torch.no_grad():
                for _ in range(MAX_TOKENS):
                    step = model(ids, past_key_values=past, use_cache=True)
                    past, ids = step.past_key_values, step.logits[:, -1].argmax(-1, keepdim=True)
                    new.append(int(ids))
            rows.append(new)
        out.append(rows)
    return out


def generate_in_child(model_dir, python_env, **switches) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, str(model_dir)],
        env=python_env(**switches),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def atom_run(smollm2_dir):
    from atom_vllm_plugin.stats import counters

    before = counters.snapshot()
    result = generate(str(smollm2_dir))
    after = counters.snapshot()
    result["counters"] = {k: after[k] - before[k] for k in after}
    return result


def test_run_went_through_atom_model_and_attention(atom_run) -> None:
    assert atom_run["model"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert atom_run["inner"] == "atom_models.models.llama.LlamaForCausalLM"
    assert atom_run["attention"] == ["atom_vllm_plugin.attention.backend.AtomAttentionImpl"]
    counts = atom_run["counters"]
    num_layers = 30  # SmolLM2-135M
    assert counts["models_built"] == 1
    assert counts["attention_impls"] == num_layers
    # Every step ran ATOM's forward, and every layer of it ATOM's attention and cache write.
    assert counts["model_forwards"] >= MAX_TOKENS * len(BATCHES)
    assert counts["attention_forwards"] == num_layers * counts["model_forwards"]
    assert counts["kv_cache_writes"] == num_layers * counts["model_forwards"]
    assert atom_run["cached_tokens"] > 0  # the prefix cache was hit and attended over


def test_greedy_tokens_match_vllms_own_model(atom_run, smollm2_dir, python_env) -> None:
    own = generate_in_child(smollm2_dir, python_env, ATOM_DISABLE_VLLM_PLUGIN="1")
    assert own["model"] == "vllm.model_executor.models.llama.LlamaForCausalLM"
    assert own["attention"] == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"]
    assert atom_run["tokens"] == own["tokens"]


def test_atom_model_on_vllms_attention(atom_run, smollm2_dir, python_env) -> None:
    mixed = generate_in_child(smollm2_dir, python_env, ATOM_DISABLE_VLLM_PLUGIN_ATTENTION="1")
    assert mixed["model"] == "atom_vllm_plugin.model.AtomForCausalLM"
    assert mixed["attention"] == ["vllm.v1.attention.backends.cpu_attn.CPUAttentionBackendImpl"]
    assert atom_run["tokens"] == mixed["tokens"]


def test_greedy_tokens_match_transformers(atom_run, smollm2_dir) -> None:
    assert atom_run["tokens"] == transformers_tokens(str(smollm2_dir))


if __name__ == "__main__":
    print(json.dumps(generate(sys.argv[1])))
