"""Two GPUs over NCCL: `tensor_parallel_size=2` gives one GPU's results (issue 18).

Random checkpoints of a Llama and a Qwen3-MoE shape (4 layers, hidden 512, 4,096-token vocabulary),
TP=2 against TP=1 on the same weights:
- float32: the greedy tokens are equal, with CUDA graphs, async scheduling, prefix caching (the
  second pass over the prompts hits the cache) and preemption (a cache too small for the batch);
  the MoE also with expert parallelism (whole experts per GPU);
- bfloat16: the log-probs of every prompt token and of the greedy tokens (while both agree on the
  tokens) are within BF16_LOGPROB_TOL of one GPU's (the MoE's: 99% of them, see MOE_QUANTILE), and
  one GPU's top token is in TP=2's top 5.

Each test has a CPU variant (gloo, `device="cpu"`), collected with ATOM_MULTI_GPU_ON_CPU=1 and
marked slow: a worker's start-up takes a minute or more on a loaded 2-core machine. It runs the
same code path without GPUs (`ATOM_MULTI_GPU_ON_CPU=1 pytest --run-slow -k cpu`).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from transformers import LlamaConfig, Qwen3MoeConfig

from atom_engine import LLM, SamplingParams
from atom_models.testing import save_random_checkpoint

# The same cases ran on the CPU (gloo) when they were written (1-4 min per TP=2 engine on 2
# cores, see benchmarks/README.md); CI keeps the CPU's tensor-parallel checks in
# test_tensor_parallel_engine.py. ATOM_MULTI_GPU_ON_CPU=1 adds the CPU variants (slow).
DEVICES = [pytest.param("cuda", marks=pytest.mark.multi_gpu(2))]
if os.environ.get("ATOM_MULTI_GPU_ON_CPU") == "1":
    DEVICES.append(pytest.param("cpu", marks=pytest.mark.slow))

BASE = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    max_position_embeddings=1024,
    tie_word_embeddings=False,
)
CONFIGS = {
    # 2 KV heads: one per rank.
    "llama": lambda: LlamaConfig(**BASE, num_key_value_heads=2),
    # 16 experts, top-4: TP slices every expert's 256 features in two; EP gives each rank 8.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **BASE,
        num_key_value_heads=4,
        head_dim=64,
        moe_intermediate_size=256,
        num_experts=16,
        num_experts_per_tok=4,
        norm_topk_prob=True,
    ),
}
CASES = [
    pytest.param("llama", {}, id="llama-tp2"),
    pytest.param("qwen3_moe", {}, id="qwen3_moe-tp2"),
    pytest.param("qwen3_moe", dict(enable_expert_parallel=True), id="qwen3_moe-tp2-ep"),
]

BLOCK_SIZE = 16
MAX_TOKENS = 24
# bf16 log-probs, TP=2 against TP=1: the bound test_gpu_engine.py holds bf16 to against float32
# on one GPU. TP=2 sums each layer's two partial outputs in bf16 (NCCL) where one GPU sums in the
# GEMM's fp32 accumulator: one bf16 rounding more per all-reduce, 8 of them in these 4 layers.
BF16_LOGPROB_TOL = 0.15
# NOTE: an MoE layer picks its top-k experts from bf16 router logits, so one rounding more can send
# a token to another expert. On the CPU (gloo, 2026-11-23) the Qwen3-MoE's bf16 log-probs moved,
# TP=2 (EP) against TP=1: max 0.40, 99th percentile 0.25, mean 0.017; one rank's bf16 against its
# float32: max 0.40, 99th percentile 0.21, mean 0.022. So the MoE's TP=2 deviation is held to twice
# one GPU's own bf16 deviation from float32 (99th percentile and mean), not to a fixed maximum.
MOE_QUANTILE = 0.99


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()  # engines hold reference cycles (runner <-> CUDA graphs)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            save_random_checkpoint(CONFIGS[name](), path, seed=5)
            made[name] = path
        return made[name]

    return get


def prompts() -> list[list[int]]:
    """12 prompts of 1-148 tokens; 9 start with the same 3 blocks (prefix-cache hits)."""
    gen = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, BASE["vocab_size"], (3 * BLOCK_SIZE,), generator=gen).tolist()
    out = []
    for i, n in enumerate(torch.randint(1, 101, (12,), generator=gen).tolist()):
        tail = torch.randint(0, BASE["vocab_size"], (n,), generator=gen).tolist()
        out.append(tail if i % 4 == 3 else prefix + tail)
    return out


def num_blocks(n: int) -> int:
    return -(-n // BLOCK_SIZE)


def engine_args(device: str, dtype: str, **extra) -> dict:
    return dict(
        device=device,
        dtype=dtype,
        skip_tokenizer_init=True,
        block_size=BLOCK_SIZE,
        max_num_seqs=16,  # CUDA graphs of 1-16 sequences: the whole batch decodes in one
        **extra,
    )


_tp1: dict[tuple, object] = {}


def tp1_once(key: tuple, run):
    """One GPU's result of `key`, computed once per module (several TP=2 cases compare to it)."""
    if key not in _tp1:
        _tp1[key] = run()
    return _tp1[key]


def greedy_two_passes(path, device: str, **args) -> dict:
    """Greedy tokens of the prompts, twice on one engine (the second pass from the prefix cache),
    with a KV cache twice the longest sequence: too small for the batch, so sequences are
    preempted and recomputed."""
    batch = prompts()
    need = [num_blocks(len(p) + MAX_TOKENS) for p in batch]
    cache = 2 * max(need)
    assert sum(need) - 3 * len(batch) > 2 * cache, "the batch must overflow the cache"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ins = [{"prompt_token_ids": p} for p in batch]
    with LLM(str(path), **engine_args(device, "float32", num_kv_blocks=cache, **args)) as llm:
        passes, hits = [], []
        for _ in range(2):
            before = llm.engine.block_manager.num_hit_tokens
            outs = llm.generate(ins, params, use_tqdm=False)
            passes.append([o.outputs[0].token_ids for o in outs])
            hits.append(llm.engine.block_manager.num_hit_tokens - before)
        return dict(
            tokens=passes,
            hits=hits,
            preemptions=llm.engine.stats().num_preemptions,
            graphs=llm.engine.runner.graphs is not None,
            async_scheduling=llm.engine.async_scheduling,
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "tp_args"), CASES)
def test_tp2_float32_greedy_equals_tp1(checkpoint, device, name, tp_args):
    path = checkpoint(name)
    one = tp1_once((name, device, "float32"), lambda: greedy_two_passes(path, device))
    two = greedy_two_passes(path, device, tensor_parallel_size=2, **tp_args)
    assert len(two["tokens"][0]) == len(prompts())
    assert all(len(t) == MAX_TOKENS for t in two["tokens"][0])
    assert two["tokens"] == one["tokens"]
    assert two["tokens"][1] == two["tokens"][0]  # the cached pass decodes the same tokens
    for run in (one, two):
        assert run["preemptions"] > 0, "the cache was meant to be too small for the batch"
        assert run["hits"][1] > 0, "the second pass was meant to hit the prefix cache"
        assert run["graphs"] == (device == "cuda")
        assert run["async_scheduling"] == (device == "cuda")


def logprobs(path, device: str, dtype: str = "bfloat16", **args) -> list:
    """Per prompt: (greedy tokens, their log-probs (top 5 each), prompt log-probs (top 5))."""
    params = SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5, prompt_logprobs=5
    )
    ins = [{"prompt_token_ids": p} for p in prompts()]
    with LLM(str(path), **engine_args(device, dtype, num_kv_blocks=256, **args)) as llm:
        outs = llm.generate(ins, params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]


def compare_logprobs(ref: dict, got: dict, token: int, check_top: bool = True) -> float:
    """|difference| of `token`'s log-prob; one GPU's most likely token must be in TP=2's top."""
    top = max(ref, key=lambda t: ref[t].logprob)
    assert top in got or not check_top, f"one GPU's top token {top} is not in TP=2's top 5 {got}"
    return abs(ref[token].logprob - got[token].logprob)


def deviations(ref, got, check_top: bool = True) -> tuple[list[float], int]:
    """|log-prob differences| of every prompt token and of the greedy tokens while both runs agree
    on them (with `check_top`, one GPU's top token must be in the other run's top 5), and how many
    greedy tokens agreed."""
    diffs, agreed = [], 0
    for prompt, (ref_ids, ref_lp, ref_plp), (ids, lp, plp) in zip(prompts(), ref, got, strict=True):
        assert len(plp) == len(ref_plp) == len(prompt)
        for position, (a, b) in enumerate(zip(ref_plp[1:], plp[1:], strict=True), start=1):
            diffs.append(compare_logprobs(a, b, prompt[position], check_top))
        for step, (a, b) in enumerate(zip(ref_ids, ids, strict=True)):
            if a != b:  # past a near-tie the sequences differ: nothing more to compare
                break
            diffs.append(compare_logprobs(ref_lp[step], lp[step], a, check_top))
            agreed += 1
    return sorted(diffs), agreed


def stats(diffs: list[float]) -> tuple[float, float, float]:
    """(max, MOE_QUANTILE quantile, mean) of sorted differences."""
    return diffs[-1], diffs[int(MOE_QUANTILE * (len(diffs) - 1))], sum(diffs) / len(diffs)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "tp_args"), CASES)
def test_tp2_bf16_logprobs_close_to_tp1(checkpoint, device, name, tp_args):
    path = checkpoint(name)
    one = tp1_once((name, device, "bfloat16"), lambda: logprobs(path, device))
    two = logprobs(path, device, tensor_parallel_size=2, **tp_args)
    diffs, agreed = deviations(one, two)
    worst, quantile, mean = stats(diffs)
    print(
        f"{name} {tp_args}: {len(diffs)} log-probs, max |diff| {worst:.4f}, "
        f"{MOE_QUANTILE:.0%} {quantile:.4f}, mean {mean:.4f}, {agreed} greedy tokens agreed"
    )
    assert agreed >= len(prompts())  # at least as many tokens as prompts compared past prefill
    if name != "qwen3_moe":
        assert worst < BF16_LOGPROB_TOL
        return
    # Routed experts: against one GPU's own bf16 deviation from float32 (see MOE_QUANTILE).
    f32 = tp1_once((name, device, "float32-logprobs"), lambda: logprobs(path, device, "float32"))
    # (no top-5 check: float32 and bf16 order a near-flat top differently)
    _, noise_quantile, noise_mean = stats(deviations(f32, one, check_top=False)[0])
    print(f"  one GPU, bf16 against float32: {MOE_QUANTILE:.0%} {noise_quantile:.4f}, "
          f"mean {noise_mean:.4f}")  # fmt: skip
    assert quantile <= 2 * noise_quantile
    assert mean <= 2 * noise_mean
