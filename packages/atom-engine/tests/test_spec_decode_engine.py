"""Speculative decoding in the engine (n-gram prompt lookup): greedy outputs equal those without
speculation token for token (batched, prefix caching on, a stop string inside an accepted run),
sampled outputs follow the same distribution (chi-square, 20,000 samples), the acceptance is
reported, and every KV block returns to the pool."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from atom_engine import LLM, SamplingParams

# Prompts with repetition (prompt lookup finds drafts) and without (it finds few).
PROMPTS = [
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Explain in one paragraph why the sky is blue.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def ngram(k: int, n: int = 3) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
            "prompt_lookup_min": 1}  # fmt: skip


def spec_llm(k: int, **kwargs) -> LLM:
    # The settings of the conftest's smollm2_llm (the reference), plus speculation.
    return LLM(
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=256,
        speculative_config=ngram(k),
        **kwargs,
    )


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_pool_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert not llm.engine.has_unfinished_requests()
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks still held after every request ended"
    assert all(count == 0 for count in bm.ref_counts)


@pytest.fixture(scope="module")
def smollm2_spec3():
    with spec_llm(3) as llm:
        yield llm


def check_greedy_parity(smollm2_llm, llm: LLM, k: int) -> None:
    expected = token_ids(smollm2_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    for _ in range(2):  # the second pass starts from prompts in the prefix cache
        assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == expected
        assert_pool_free(llm)
    assert llm.engine.block_manager.hit_rate > 0.4
    stats = llm.engine.stats().spec_decode
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    assert 0.0 < stats.acceptance_rate <= 1.0
    assert len(stats.acceptance_rate_per_position()) <= k


def test_greedy_equals_no_speculation_k3_with_a_stop_inside_an_accepted_run(
    smollm2_llm, smollm2_spec3
):
    llm = smollm2_spec3
    check_greedy_parity(smollm2_llm, llm, 3)
    # Find a token that came out of an accepted run (not the last token of a step) on the
    # repetitive prompt, and stop on its text: the output must end exactly where the plain
    # engine's does.
    engine = llm.engine
    engine.add_request("run", PROMPTS[1], GREEDY)
    runs: list[list[int]] = []
    seen = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids = out.outputs[0].token_ids
            runs.append(ids[seen:])
            seen = len(ids)
    inside = [(ids, i) for ids in runs for i in range(len(ids) - 1)]
    assert inside, "no step emitted more than one token: nothing was accepted"
    tokenizer = llm.get_tokenizer()
    text = tokenizer.decode([t for run in runs for t in run])
    stop = None
    for ids, i in inside:
        piece = tokenizer.decode(ids[: i + 1]).strip()
        if len(piece) >= 2 and piece in text:
            stop = piece
            break
    assert stop is not None
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=[stop])
    (plain,) = smollm2_llm.generate([PROMPTS[1]], params, use_tqdm=False)
    (spec,) = llm.generate([PROMPTS[1]], params, use_tqdm=False)
    assert plain.outputs[0].finish_reason == "stop" and plain.outputs[0].stop_reason == stop
    assert spec.outputs[0].text == plain.outputs[0].text
    assert spec.outputs[0].token_ids == plain.outputs[0].token_ids
    assert (spec.outputs[0].finish_reason, spec.outputs[0].stop_reason) == ("stop", stop)
    assert_pool_free(llm)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 5])
def test_greedy_equals_no_speculation(smollm2_llm, k):
    with spec_llm(k) as llm:
        check_greedy_parity(smollm2_llm, llm, k)


def test_max_tokens_and_logprobs_inside_accepted_runs(smollm2_llm, smollm2_spec3):
    """max_tokens ends a sequence inside an accepted run; log-probs come for every emitted token
    and equal those without speculation (same logits row per token)."""
    params = SamplingParams(temperature=0.0, max_tokens=13, logprobs=2)
    (plain,) = smollm2_llm.generate([PROMPTS[0]], params, use_tqdm=False)
    llm = smollm2_spec3
    accepted = llm.engine.stats().spec_decode.num_accepted_tokens
    (spec,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert llm.engine.stats().spec_decode.num_accepted_tokens > accepted
    a, b = plain.outputs[0], spec.outputs[0]
    assert b.token_ids == a.token_ids and len(b.token_ids) == 13 and b.finish_reason == "length"
    assert len(b.logprobs) == 13
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert list(x) == list(y)  # the same token ids, in rank order
        for t in x:
            assert y[t].rank == x[t].rank
            assert y[t].logprob == pytest.approx(x[t].logprob, abs=1e-4)
    assert_pool_free(llm)


def test_logit_bias_equals_no_speculation(smollm2_llm, smollm2_spec3):
    """logit_bias applies to the target's rows when drafts are verified: a banned token that
    the n-gram drafter keeps proposing is never emitted, and greedy outputs with a bias equal
    those without speculation."""
    tokenizer = smollm2_llm.get_tokenizer()
    # Digits are tokens of their own in SmolLM2's vocabulary ("1, 2," is 1 , Ġ 2 ,).
    (four,) = tokenizer.encode("4", add_special_tokens=False)
    (mat,) = tokenizer.encode(" mat", add_special_tokens=False)
    (seven,) = tokenizer.encode("7", add_special_tokens=False)
    params = SamplingParams(
        temperature=0.0, max_tokens=24, logit_bias={four: -100, mat: -100, seven: 5.0}
    )
    plain = token_ids(smollm2_llm.generate(PROMPTS[:2], params, use_tqdm=False))
    llm = smollm2_spec3
    drafted = llm.engine.stats().spec_decode.num_draft_tokens
    assert token_ids(llm.generate(PROMPTS[:2], params, use_tqdm=False)) == plain
    assert llm.engine.stats().spec_decode.num_draft_tokens > drafted
    assert all(four not in ids and mat not in ids for ids in plain)
    assert_pool_free(llm)


# -- losslessness at temperature > 0 ----------------------------------------------------------

VOCAB = 6
N_SAMPLES = 20000


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from atom_models.testing import save_random_checkpoint

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=0, eos_token_id=VOCAB - 1, tie_word_embeddings=False,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-llama-spec")
    save_random_checkpoint(config, path, seed=3)
    return str(path)


_samples: dict = {}


def first_tokens(path: str, params: SamplingParams, speculative_config) -> torch.Tensor:
    """The first 3 generated tokens of N_SAMPLES samples of one prompt, as cell ids [N] (and
    the speculation statistics); computed once per setting."""
    key = (path, params.temperature, params.top_p, repr(speculative_config))
    if key not in _samples:
        _samples[key] = _first_tokens(path, params, speculative_config)
    return _samples[key]


def _first_tokens(path: str, params: SamplingParams, speculative_config):
    llm = LLM(
        path, dtype="float32", device="cpu", skip_tokenizer_init=True, max_num_seqs=512,
        max_num_batched_tokens=4096, speculative_config=speculative_config, seed=11,
    )  # fmt: skip
    # Every first token occurred in the prompt: lookup always drafts what followed it there.
    prompt = {"prompt_token_ids": [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 1, 3]}
    outputs = llm.generate([prompt] * N_SAMPLES, params, use_tqdm=False)
    ids = torch.tensor([o.outputs[0].token_ids for o in outputs])
    assert ids.shape == (N_SAMPLES, 3)
    stats = llm.engine.stats().spec_decode
    assert_pool_free(llm)
    llm.shutdown()
    return ids[:, 0] * VOCAB * VOCAB + ids[:, 1] * VOCAB + ids[:, 2], stats


def chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the two-sample chi-square test of homogeneity over the cells (cells expected
    to hold fewer than 5 samples pooled into one)."""
    ca = torch.bincount(a, minlength=VOCAB**3).double()
    cb = torch.bincount(b, minlength=VOCAB**3).double()
    total = ca + cb
    small = total / 2 < 5
    ca = torch.cat([ca[~small], ca[small].sum()[None]])
    cb = torch.cat([cb[~small], cb[small].sum()[None]])
    total = ca + cb
    keep = total > 0
    ca, cb, total = ca[keep], cb[keep], total[keep]
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = ((ca - ea) ** 2 / ea + (cb - eb) ** 2 / eb).sum()
    df = torch.tensor(float(len(total) - 1), dtype=torch.float64)
    return torch.special.gammaincc(df / 2, stat / 2).item()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True),
    ],
    ids=["temperature-1", "top-p-0.9"],
)
def test_sampled_tokens_follow_the_distribution_without_speculation(tiny_llama, params):
    plain, _ = first_tokens(tiny_llama, params, None)
    spec, stats = first_tokens(tiny_llama, params, ngram(2, 1))
    # Drafts were proposed for every sample's second and third tokens, and some accepted,
    # some rejected: both branches of the verification shaped the sample.
    assert stats.num_draft_tokens >= N_SAMPLES
    assert 0.05 < stats.acceptance_rate < 0.95
    p = chi_square_p(plain, spec)
    assert p > 0.01, f"speculative samples differ from plain ones (chi-square p = {p:.2e})"
    # The test can fail: a sampler that ignores top-p is told apart from one that applies it.
    if params.top_p < 1.0:
        other, _ = first_tokens(tiny_llama, SamplingParams(temperature=1.0, max_tokens=3,
                                                          ignore_eos=True), None)  # fmt: skip
        assert chi_square_p(other, spec) < 1e-6


# -- MTP drafts (DeepSeek-V3) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_deepseek_mtp(tmp_path_factory):
    """A tiny DeepSeek-V3 (MoE MTP layer) with a small vocabulary, so that the random MTP
    layer's argmax drafts are accepted now and then and verification takes both branches."""
    from transformers import DeepseekV3Config

    from atom_models.testing import add_random_mtp_layers, save_random_checkpoint

    config = DeepseekV3Config(
        vocab_size=12, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, tie_word_embeddings=False, n_routed_experts=8,
        kv_lora_rank=32, qk_rope_head_dim=8, first_k_dense_replace=1, q_lora_rank=48,
        qk_nope_head_dim=16, v_head_dim=24, n_group=4, topk_group=2, num_experts_per_tok=2,
        bos_token_id=0, eos_token_id=11,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tiny-deepseek-mtp")
    save_random_checkpoint(config, path, seed=5)
    add_random_mtp_layers(path, 1, seed=6)
    return str(path)


def test_mtp_greedy_equals_no_speculation(tiny_deepseek_mtp):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 11, (n,), generator=gen).tolist() for n in (5, 19, 40, 70)]
    prompts.append(prompts[2][:33] + [3, 4])  # shares two full blocks with another prompt
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    args = dict(dtype="float32", device="cpu", skip_tokenizer_init=True, block_size=16,
                num_kv_blocks=128, max_num_batched_tokens=64)  # fmt: skip
    batch = [{"prompt_token_ids": p} for p in prompts]
    with LLM(tiny_deepseek_mtp, **args) as llm:
        assert llm.engine.runner.model.num_mtp_layers == 0  # not built when not drafting
        expected = token_ids(llm.generate(batch, params, use_tqdm=False))
    for k in (1, 2):
        mtp = {"method": "mtp", "num_speculative_tokens": k}
        with LLM(tiny_deepseek_mtp, speculative_config=mtp, **args) as llm:
            for _ in range(2):  # the second pass from the prefix cache
                assert token_ids(llm.generate(batch, params, use_tqdm=False)) == expected, k
                assert_pool_free(llm)
            stats = llm.engine.stats().spec_decode
            assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0, stats
            assert len(stats.accepted_per_position) == k


def test_mtp_needs_mtp_layers(tiny_llama, tiny_deepseek_mtp):
    with pytest.raises(ValueError, match="method 'mtp' needs a checkpoint with multi-token"):
        LLM(tiny_llama, skip_tokenizer_init=True,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip
    with pytest.raises(ValueError, match="tensor_parallel_size 1 only"):
        LLM(tiny_deepseek_mtp, skip_tokenizer_init=True, tensor_parallel_size=2,
            speculative_config={"method": "mtp", "num_speculative_tokens": 1})  # fmt: skip


# -- the server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_with_tokenizer(tiny_checkpoint):
    path, _ = tiny_checkpoint(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            tie_word_embeddings=True,  # greedy text that repeats: drafts that get accepted
        )  # fmt: skip
    )
    return path


@pytest.mark.slow  # a worker process's start on 2 cores
def test_tensor_parallel_verifies_like_one_rank(tiny_llama_with_tokenizer):
    prompts = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1,", "a b c a b c a b", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    path = str(tiny_llama_with_tokenizer)
    with LLM(path, num_kv_blocks=64) as llm:
        expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(path, num_kv_blocks=64, tensor_parallel_size=2, speculative_config=ngram(3)) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
        assert_pool_free(llm)


def test_serve_flag_and_metrics(tiny_llama_with_tokenizer):
    """`--speculative-config` parses as vLLM's (a bad one is an error naming the field), and a
    server with speculation answers like one without and reports the drafts on /metrics."""
    import argparse
    import dataclasses

    from atom_engine.cli.args import add_engine_args, engine_config_from_args
    from atom_engine.server.api_server import build_app
    from atom_engine.server.async_engine import AsyncEngine
    from atom_engine.testing import http, serve, wait_idle

    parser = add_engine_args(argparse.ArgumentParser(exit_on_error=False))
    raw = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2}'
    config = engine_config_from_args(parser.parse_args(["--speculative-config", raw]))
    assert config.resolved_speculative_config().prompt_lookup_min == 2  # max stands for min
    raw = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
    config = engine_config_from_args(parser.parse_args(["--speculative-config", raw]))
    assert config.resolved_speculative_config().prompt_lookup_max == 1
    with pytest.raises(argparse.ArgumentError, match="not valid JSON"):
        parser.parse_args(["--speculative-config", "{method: ngram}"])
    with pytest.raises(ValueError, match="num_speculative_tokens must be a positive integer"):
        engine_config_from_args(
            parser.parse_args(
                ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": -1}']
            )  # fmt: skip
        )

    path = tiny_llama_with_tokenizer
    prompts = ["1, 2, 3, 1, 2, 3, 1, 2, 3, 1,", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(path), num_kv_blocks=64) as llm:
        expected = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    config = dataclasses.replace(config, model=str(path), device="cpu", num_kv_blocks=64)
    engine = AsyncEngine.from_config(config)
    server = serve(build_app(engine, "tiny"), engine)
    try:
        client = server.client()
        got = [
            client.completions.create(
                model="tiny", prompt=p, max_tokens=24, temperature=0.0,
                extra_body={"ignore_eos": True},
            ).choices[0].text
            for p in prompts
        ]  # fmt: skip
        assert got == expected
        wait_idle(engine)
        metrics = http("GET", server.url + "/metrics").text
        stats = engine.stats().spec_decode
        assert stats.num_draft_tokens > 0
        assert f"atom:spec_decode_num_draft_tokens_total {stats.num_draft_tokens}.0" in metrics
        assert f"atom:spec_decode_num_accepted_tokens_total {stats.num_accepted_tokens}.0" in (
            metrics
        )
        assert 'atom:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics
    finally:
        server.stop()
        engine.shutdown()


# -- on a GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_speculation(tmp_path, tiny_deepseek_mtp):
    """On CUDA (float32, CUDA graphs for the steps without drafts, the Triton rejection
    sampler): greedy n-gram and MTP speculation give the plain engine's tokens; sampled
    speculation with seeds repeats itself."""
    from atom_models.testing import save_random_checkpoint

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,  # greedy text that repeats: drafts that get accepted
    )  # fmt: skip
    save_random_checkpoint(config, tmp_path, seed=1)
    gen = torch.Generator().manual_seed(2)
    prompts = [{"prompt_token_ids": torch.randint(1, 500, (n,), generator=gen).tolist() * 2}
               for n in (3, 9, 20)]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    args = dict(device="cuda", dtype="float32", num_kv_blocks=64, skip_tokenizer_init=True)
    with LLM(str(tmp_path), **args) as llm:
        assert llm.engine.runner.graphs is not None
        expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    with LLM(str(tmp_path), speculative_config=ngram(3), **args) as llm:
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
        sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=32, seed=7,
                                 ignore_eos=True)  # fmt: skip
        first = token_ids(llm.generate(prompts, sampled, use_tqdm=False))
        assert token_ids(llm.generate(prompts, sampled, use_tqdm=False)) == first
        assert all(len(ids) == 32 for ids in first)
        assert_pool_free(llm)
    batch = [{"prompt_token_ids": torch.randint(1, 11, (n,), generator=gen).tolist()}
             for n in (5, 40)]  # fmt: skip
    args.update(block_size=16)
    with LLM(tiny_deepseek_mtp, **args) as llm:
        expected = token_ids(llm.generate(batch, params, use_tqdm=False))
    mtp = {"method": "mtp", "num_speculative_tokens": 2}
    with LLM(tiny_deepseek_mtp, speculative_config=mtp, **args) as llm:
        assert token_ids(llm.generate(batch, params, use_tqdm=False)) == expected
        assert llm.engine.stats().spec_decode.num_draft_tokens > 0
        assert_pool_free(llm)
