"""The decode-graph path of async scheduling (the GPU's decode steps) run on the CPU: the real
`DecodeGraphs` staging (block-table rows written incrementally, placeholder gathers, padding
rows) and the engine's decode fast paths, with each graph replayed eagerly over its buffers.
Greedy outputs must equal the synchronous eager engine's, through preemption, prefix caching, stop
tokens and sequences finishing at different steps (the batch's rows shifting)."""

from __future__ import annotations

import pytest

from atom_engine import EngineConfig, LLMEngine, SamplingParams
from atom_engine.testing import eager_decode_graphs


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    from transformers import Qwen3Config

    from atom_models.testing import save_random_checkpoint

    config = Qwen3Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("qwen3")
    save_random_checkpoint(config, path, seed=3)
    return str(path)


def _generate(engine: LLMEngine, prompts, max_tokens, stops=None) -> dict[str, tuple]:
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        stop = [stops[i]] if stops and i in stops else None
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, stop_token_ids=stop)
        engine.add_request(str(i), prompt, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].finish_reason)
    return out


def _engine(path: str, **kwargs) -> LLMEngine:
    args = dict(
        model=path,
        skip_tokenizer_init=True,
        dtype="float32",
        device="cpu",
        enforce_eager=True,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=1024,
        num_threads=1,
    )
    return LLMEngine(EngineConfig(**args, **kwargs))


@pytest.mark.parametrize("num_kv_blocks", [200, 14], ids=["roomy", "preempting"])
def test_decode_graphs_match_eager(tiny_qwen3, num_kv_blocks):
    shared = [(5 * j + 1) % 500 for j in range(40)]  # a prefix the cache serves
    prompts = [shared + [(11 * i + j) % 500 for j in range(3 + 7 * i)] for i in range(10)]
    prompts.append([9] * 17)
    max_tokens = [5 + 4 * (i % 5) for i in range(10)] + [40]
    plain = _generate(_engine(tiny_qwen3, num_kv_blocks=400), prompts, max_tokens)
    # Every other request stops on a token it samples mid-way (a stop with one in flight).
    stops = {i: plain[str(i)][0][len(plain[str(i)][0]) // 2] for i in range(0, 11, 2)}
    expected = _generate(_engine(tiny_qwen3, num_kv_blocks=400), prompts, max_tokens, stops)
    assert sum(reason == "stop" for _, reason in expected.values()) >= 3

    engine = _engine(tiny_qwen3, async_scheduling=True, num_kv_blocks=num_kv_blocks)
    graphs = eager_decode_graphs(engine.runner)
    replays = []
    run = graphs.run

    def checked_run(ids, seq_lens, tables, gathers):
        out = run(ids, seq_lens, tables, gathers)
        replays.append(len(ids))
        for i, (seq_len, table) in enumerate(zip(seq_lens, tables, strict=True)):
            # The graph's buffers hold every block the sequence's keys are in.
            assert graphs.block_tables[i, : len(table)].tolist() == table
            assert graphs.seq_lens[i].item() == seq_len
            assert graphs.positions[i].item() == seq_len - 1
        return out

    graphs.run = checked_run
    assert _generate(engine, prompts, max_tokens, stops) == expected
    assert len(set(replays)) > 2  # several batch sizes (padding rows, shifting rows)
    if num_kv_blocks < 100:
        assert engine.stats().num_preemptions > 0
    assert engine.block_manager.usage == 0.0
