"""Tensor parallelism through vLLM's own TP group: ATOM's model sharded over two vLLM CPU workers
(gloo) gives the greedy tokens of the unsharded model, on a tiny random Llama (no tokenizer).

The TP=1 run is vLLM's in-process engine in this process; the TP=2 run is this file as a script in
a fresh process, with vLLM's multiprocess executor and one core bound per worker (vLLM's CPU
workers need explicit binding on one NUMA node).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest

PROMPTS = [[1, 5, 9, 33, 200, 17], list(range(3, 60))]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from transformers import LlamaConfig

    from atom_models.testing import save_random_checkpoint

    path = tmp_path_factory.mktemp("tiny-llama-tp")
    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
    )  # fmt: skip
    save_random_checkpoint(config, path)
    return path


def generate(model_dir: str, tp: int) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
              max_model_len=256, tensor_parallel_size=tp, seed=0, block_size=32)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            detokenize=False)  # fmt: skip
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def run_tp2(model_dir, python_env) -> tuple[dict, str]:
    env = python_env()  # worker processes, one core each
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="0|1")
    proc = subprocess.run(
        [sys.executable, __file__, str(model_dir), "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    result = [line for line in proc.stdout.splitlines() if line.startswith('{"tokens"')]
    return json.loads(result[-1]), proc.stdout + proc.stderr


def test_tp2_matches_tp1(tiny_llama, python_env) -> None:
    single = generate(str(tiny_llama), 1)
    gc.collect()  # this process's engine, before two workers start
    sharded, log = run_tp2(tiny_llama, python_env)
    # Both ranks built ATOM's model on their shard, in vLLM's TP group.
    for rank in (0, 1):
        assert f"ATOM: model atom_models.models.llama.LlamaForCausalLM for {tiny_llama} " \
               f"(tp rank {rank} of 2" in log  # fmt: skip
    assert "ATOM: attention backend ATOM" in log
    assert sharded["tokens"] == single["tokens"]
    assert all(len(t) == MAX_TOKENS for t in single["tokens"])


if __name__ == "__main__":
    print(json.dumps(generate(sys.argv[1], int(sys.argv[2]))))
