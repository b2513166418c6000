"""Greedy generation through the engine equals transformers' token for token (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from atom_engine import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old",
    "Q: What is the boiling point of water at sea level?\nA:",
]
CHAT = [{"role": "user", "content": "Name three primary colors."}]


def test_bundled_smollm2_matches_transformers_with_prefix_cache_hits(
    smollm2_llm, smollm2_hf, greedy_reference
):
    llm = smollm2_llm
    tok = llm.get_tokenizer()
    prompt_ids = [tok.encode(p) for p in PROMPTS]
    prompt_ids.append(llm.apply_chat_template(CHAT))
    eos = tok.eos_token_id
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = [greedy_reference(smollm2_hf, ids, 24, eos) for ids in prompt_ids]

    batch = [{"prompt_token_ids": ids} for ids in prompt_ids]
    first = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == expected
    for out, exp in zip(first, expected, strict=True):
        stopped = exp[-1] == eos and len(exp) <= 24
        assert out.outputs[0].finish_reason == ("stop" if stopped else "length")
        assert out.outputs[0].text == tok.decode(exp, skip_special_tokens=True)

    # Second pass over the same prompts: their full blocks come from the prefix cache.
    hits_before = llm.engine.block_manager.num_hit_tokens
    second = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == expected
    hits = llm.engine.block_manager.num_hit_tokens - hits_before
    block = llm.engine.config.block_size
    assert hits == sum((len(ids) - 1) // block * block for ids in prompt_ids)
    assert sum(o.num_cached_tokens for o in second) == hits
    assert llm.engine.stats().prefix_cache_hit_rate > 0


TINY = dict(
    vocab_size=49152,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tiny_checkpoint, greedy_reference):
    """(checkpoint directory, prompts, transformers' greedy tokens), computed once per model for
    all the engine settings below."""
    if request.param == "llama":
        config = LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2)
    else:
        config = Qwen3Config(**TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    path, hf = tiny_checkpoint(config, seed=11)
    prompts = random_prompts(12, seed=5)
    return path, prompts, [greedy_reference(hf, p, 20, None) for p in prompts]


def random_prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 70, (n,), generator=gen).tolist()
    return [torch.randint(3, 49152, (k,), generator=gen).tolist() for k in lengths]


ENGINE_ARGS = {
    "plain": dict(block_size=16),
    # A budget smaller than most prompts: chunked prefill mixed with decodes every step.
    "chunked-prefill": dict(block_size=4, max_num_batched_tokens=24, max_num_seqs=5),
    # A cache of 40 blocks x 4 tokens for 12 sequences of up to 90 tokens: preemption.
    "preemption": dict(block_size=4, num_kv_blocks=40),
}
# Each again with async scheduling (the CUDA default): steps launched before the previous one's
# ids are read, placeholders filled in on the device.
for name, args in list(ENGINE_ARGS.items()):
    ENGINE_ARGS[f"{name}-async"] = dict(args, async_scheduling=True)


@pytest.mark.parametrize("engine_args", ENGINE_ARGS.values(), ids=ENGINE_ARGS.keys())
def test_tiny_checkpoints_match_transformers(tiny, engine_args):
    path, prompts, expected = tiny
    llm = LLM(str(path), dtype="float32", device="cpu", **engine_args)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    stats = llm.engine.stats()
    if "num_kv_blocks" in engine_args:
        assert stats.num_preemptions > 0
    # Every block is back in the pool (finished requests keep nothing but cached hashes).
    assert stats.kv_cache_usage == 0.0 and stats.num_running == stats.num_waiting == 0
