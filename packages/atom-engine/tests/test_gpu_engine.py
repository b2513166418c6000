"""The engine on a GPU: greedy parity with transformers (float32), CUDA graphs vs eager, bf16.

Tiny random checkpoints without a tokenizer (the bundled GGUF is not installed on GPU machines).
"""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from atom_engine import LLM, SamplingParams
from atom_models.native_host import attention as host_attention
from atom_models.native_host import cache_layers
from atom_models.testing import save_random_checkpoint

pytestmark = pytest.mark.gpu

# A small explicit cache: engines in one test process must not each claim 90% of the GPU.
SMALL = dict(num_kv_blocks=256)


@pytest.fixture(autouse=True)
def _free_gpu_memory():
    yield
    gc.collect()  # engines hold reference cycles (runner <-> CUDA graphs)
    torch.cuda.empty_cache()


TINY = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    max_position_embeddings=1024,
)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    if request.param == "llama":
        config = LlamaConfig(**TINY, num_attention_heads=4, num_key_value_heads=2)
    else:
        config = Qwen3Config(**TINY, num_attention_heads=4, num_key_value_heads=1, head_dim=64)
    path = tmp_path_factory.mktemp(request.param)
    return path, save_random_checkpoint(config, path, seed=3)


def prompts(n: int = 10) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 512, (int(k),), generator=gen).tolist()
        for k in torch.randint(1, 150, (n,), generator=gen)
    ]


@torch.no_grad()
def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


def generate(llm, batch, n=16):
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("mode", ["none", "full_decode_only", "full_and_piecewise", "full"])
def test_float32_greedy_matches_transformers(tiny, mode):
    """Eager, decode graphs only, and decode graphs with piecewise graphs (or whole-forward
    graphs, `full`) for the steps with a prefill (prompts of 1-150 tokens: steps padded to the
    capture ladder), prefix caching on."""
    path, hf = tiny
    batch = prompts()
    expected = [hf_greedy(hf, p, 16) for p in batch]
    llm = LLM(
        str(path),
        dtype="float32",
        device="cuda",
        skip_tokenizer_init=True,
        cudagraph_mode=mode,
        block_size=16,
        max_num_batched_tokens=256,
    )
    runner = llm.engine.runner
    assert generate(llm, batch) == expected
    assert (runner.graphs is not None) == (mode != "none")
    pieces = runner.graphs.pieces if runner.graphs is not None else None
    mixed = runner.graphs.mixed if runner.graphs is not None else None
    assert (pieces is not None) == (mode == "full_and_piecewise")
    assert (mixed is not None) == (mode == "full")
    if pieces is not None:
        assert pieces.replays > 0 and pieces.sizes[-1] == 256
    if mixed is not None:
        assert mixed.replays > 0 and mixed.sizes[-1] == 256
    # Prefix caching: the second pass hits the cache and decodes the same tokens.
    hits = llm.engine.block_manager.num_hit_tokens
    assert generate(llm, batch) == expected
    assert llm.engine.block_manager.num_hit_tokens > hits


@pytest.mark.parametrize("mode", ["full_and_piecewise", "full"])
def test_preemption_on_gpu(tiny, mode):
    path, hf = tiny
    batch = prompts(12)
    expected = [hf_greedy(hf, p, 16) for p in batch]
    llm = LLM(
        str(path),
        dtype="float32",
        device="cuda",
        skip_tokenizer_init=True,
        block_size=16,
        num_kv_blocks=24,
        cudagraph_mode=mode,
    )
    assert generate(llm, batch) == expected
    assert llm.engine.stats().num_preemptions > 0
    step_graphs = llm.engine.runner.graphs
    graphs = step_graphs.pieces if mode == "full_and_piecewise" else step_graphs.mixed
    assert graphs.replays > 0  # the recomputed prompts' steps too


@torch.no_grad()
def test_bf16_logits_close_to_float32(tiny):
    """bf16 on the GPU: the first step's log-probs stay within bf16 tolerance of float32."""
    path, _ = tiny
    batch = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5, ignore_eos=True)
    results = {}
    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(path), dtype=dtype, device="cuda", skip_tokenizer_init=True, **SMALL)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        results[dtype] = [o.outputs[0].logprobs[0] for o in outs]
        del llm
        gc.collect()
    for ref, got in zip(results["float32"], results["bfloat16"], strict=True):
        top = max(ref, key=lambda t: ref[t].logprob)
        assert top in got  # the float32 argmax is among bf16's top-5
        for tid in set(ref) & set(got):
            assert abs(ref[tid].logprob - got[tid].logprob) < 0.15


def test_kv_cache_sized_from_gpu_memory(tiny):
    path, _ = tiny
    llm = LLM(
        str(path),
        dtype="bfloat16",
        device="cuda",
        skip_tokenizer_init=True,
        gpu_memory_utilization=0.3,
    )
    runner = llm.engine.runner
    free, total = torch.cuda.mem_get_info()
    cache_bytes = runner.num_blocks * runner.kv_cache.block_bytes
    assert 0.1 * total < cache_bytes < 0.3 * total


@torch.no_grad()
def test_piecewise_prompt_logprobs_and_async_placeholders_match_eager(tiny):
    """Steps through the piecewise (and the whole-forward) graphs against eager ones: the same
    prompt log-probs (read from every row of a prefill's hidden states) and, with async
    scheduling, the same sampled tokens where a running sequence's input id is the previous
    launch's sampled id."""
    path, _ = tiny
    batch = prompts(8)
    results = {}
    for mode in ("none", "full_and_piecewise", "full"):
        llm = LLM(
            str(path),
            dtype="float32",
            device="cuda",
            skip_tokenizer_init=True,
            cudagraph_mode=mode,
            max_num_batched_tokens=512,
            **SMALL,
        )
        plain = generate(llm, batch, n=24)  # async launches: placeholders in mixed steps
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        results[mode] = (plain, [o.prompt_logprobs for o in outs])
        runner = llm.engine.runner
        if mode != "none":
            graphs = runner.graphs.pieces if mode == "full_and_piecewise" else runner.graphs.mixed
            assert graphs.replays > 0
        del llm, runner
        gc.collect()
    eager_tokens, eager_lp = results.pop("none")
    for graph_tokens, graph_lp in results.values():
        assert graph_tokens == eager_tokens
        for ref, got in zip(eager_lp, graph_lp, strict=True):
            for r, g in zip(ref[1:], got[1:], strict=True):
                for tid in r:
                    assert abs(r[tid].logprob - g[tid].logprob) < 1e-4


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_rope_in_the_cache_write_matches_the_two_ops(tiny, monkeypatch, kv_cache_dtype):
    """The rotary inside the K/V cache write (`rotary_embedding_and_cache`, the default) fills
    the cache as the rotary then `reshape_and_cache` do (ATOM_FUSED_ROPE_CACHE=0), fp8 scales
    included, through the whole-forward graphs; the layers took the path asked for."""
    path, _ = tiny
    batch = prompts()
    caches, tokens = {}, {}
    for fused in (False, True):
        monkeypatch.setattr(host_attention, "FUSE_ROPE_CACHE", fused)
        llm = LLM(
            str(path), dtype="float32", device="cuda", skip_tokenizer_init=True, block_size=16,
            max_num_batched_tokens=256, kv_cache_dtype=kv_cache_dtype, **SMALL,
        )  # fmt: skip
        tokens[fused] = generate(llm, batch, n=1)  # the prompts' K/V only: the same in both
        layers = cache_layers(llm.engine.runner.model)
        assert all((layer.rope is not None) == fused for layer in layers)
        caches[fused] = [(la.k_cache.float().cpu(), la.v_cache.float().cpu()) for la in layers]
        llm.shutdown()
        del llm, layers
        gc.collect()
        torch.cuda.empty_cache()
    for (k0, v0), (k1, v1) in zip(caches[False], caches[True], strict=True):
        for name, a, e in (("k", k1, k0), ("v", v1, v0)):
            if kv_cache_dtype == "auto":
                torch.testing.assert_close(a, e, rtol=1e-6, atol=1e-6, msg=name)
                continue
            # fp8: equal, but for entries one fp8 step apart where the fp32 rotary rounds an
            # ulp differently in the two kernels
            differ = a != e
            step = (a - e).abs() <= 0.125 * torch.maximum(a.abs(), e.abs()) + 2.0**-9
            assert bool(step[differ].all()) and int(differ.sum()) <= max(1, a.numel() // 100)
    if kv_cache_dtype == "auto":
        assert tokens[True] == tokens[False]


def w4a16_checkpoint(src, dst, symmetric: bool):
    """The tiny checkpoint at ``src`` as a W4A16 group-128 compressed-tensors one (ATOM's
    packer) at ``dst``; the LM head stays bf16, as in public checkpoints."""
    from atom_models.testing import ct_pack_quantized, write_quantized_checkpoint

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
               "symmetric": symmetric}  # fmt: skip
    quant = {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"g": {"targets": ["Linear"], "weights": weights}},
             "ignore": ["lm_head"]}  # fmt: skip

    def quantize(name, tensor):
        packed, _ = ct_pack_quantized(tensor, bits=4, group_size=128, symmetric=symmetric)
        return {f"{name[: -len('weight')]}{s}": t for s, t in packed.items()}

    return write_quantized_checkpoint(src, dst, quant, quantize)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_w4a16_fragment_layout_matches_the_rows_layout(tiny, symmetric, tmp_path, monkeypatch):
    """The tiny model as a W4A16 group-128 compressed-tensors checkpoint (ATOM's packer) in bf16,
    CUDA graphs, its layers repacked into the fragment layout (ATOM_WNA16_FRAG) or not: the
    prompts' log-probs (prefill: the interleaved loop on that layout) and those of the step
    after the first token, 6 sequences at once (the fragment kernel at 6 rows), within bf16's
    tolerance of the rows layout's."""
    from atom_kernels import envs

    dst = w4a16_checkpoint(tiny[0], tmp_path / "w4a16", symmetric)
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=5, prompt_logprobs=3,
                            ignore_eos=True)  # fmt: skip
    results = {}
    for frag in (False, True):
        monkeypatch.setattr(envs, "ATOM_WNA16_FRAG", frag)
        llm = LLM(str(dst), dtype="bfloat16", device="cuda", skip_tokenizer_init=True, **SMALL)
        layer = llm.engine.runner.model.model.layers[0].mlp.down_proj
        assert layer.quant_method._tensors(layer)[0].dim() == (4 if frag else 2)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(6)], params,
                            use_tqdm=False)  # fmt: skip
        results[frag] = [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs)
                         for o in outs]  # fmt: skip
        del llm, layer
        gc.collect()
        torch.cuda.empty_cache()
    compared = 0
    for (p_ref, t_ref, lp_ref), (p_got, t_got, lp_got) in zip(results[False], results[True],
                                                             strict=True):  # fmt: skip
        for r, g in zip(p_ref[1:], p_got[1:], strict=True):
            for tid in set(r) & set(g):
                assert abs(r[tid].logprob - g[tid].logprob) < 0.15
        if t_ref[0] == t_got[0]:  # the decode step's input is the same token
            compared += 1
            for tid in set(lp_ref[1]) & set(lp_got[1]):
                assert abs(lp_ref[1][tid].logprob - lp_got[1][tid].logprob) < 0.15
    assert compared >= 3


@pytest.mark.parametrize(
    ("quantized", "mode"),
    [(False, "full_and_piecewise"), (True, "full_decode_only")],
    ids=["bf16", "w4a16"],
)
def test_l2_prefetch_changes_no_value(tiny, quantized, mode, tmp_path, monkeypatch):
    """ATOM_L2_PREFETCH (layers/prefetch.py: each layer's next weights asked of L2 on a side
    stream, evict-last, forked at four points of the layer and joined at the model's end, inside
    the decode graphs): the prompts' and the decode steps' log-probs and tokens those without it,
    bf16 and a W4A16 checkpoint, 6 sequences at once; every stage ran (its chunk table built)."""
    path = w4a16_checkpoint(tiny[0], tmp_path / "w4a16", True) if quantized else tiny[0]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=5, prompt_logprobs=3,
                            ignore_eos=True)  # fmt: skip
    results = {}
    every = "qkv=64,attn=64,mlp=64,next=64,last"
    for spec in ("", every):
        monkeypatch.setenv("ATOM_L2_PREFETCH", spec)
        llm = LLM(str(path), dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                  cudagraph_mode=mode, **SMALL)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts(6)], params,
                            use_tqdm=False)  # fmt: skip
        layer = llm.engine.runner.model.model.layers[0]
        attn = layer.self_attn
        stages = (attn.prefetch_early, attn.prefetch, layer.mlp.prefetch_down,
                  layer.mlp.prefetch_next)  # fmt: skip
        for stage in stages:
            assert (stage._spans is not None and stage._spans.shape[0] > 0) == bool(spec)
        results[spec] = [
            (o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs
        ]
        del llm, layer, attn, stages
        gc.collect()
        torch.cuda.empty_cache()
    # The same kernels on the same inputs (the split GEMMs and attention sum in a fixed order):
    # equal but for the last bits.
    on = results[every]
    for (p_ref, t_ref, lp_ref), (p_got, t_got, lp_got) in zip(results[""], on, strict=True):
        assert t_got == t_ref
        for r, g in zip([*p_ref[1:], *lp_ref], [*p_got[1:], *lp_got], strict=True):
            assert set(r) == set(g)
            assert all(abs(r[t].logprob - g[t].logprob) < 1e-3 for t in r)
