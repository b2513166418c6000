"""`--kv-cache-dtype fp8_e4m3` under SGLang: the flag reaches ATOM's config, the checkpoint's
per-tensor k/v scales reach the RadixAttention layers SGLang's backends read them from (under
every name checkpoints give them), and ATOM's model runs on an fp8 pool of SGLang's.

SGLang's torch-native backend (the one that runs on the CPU) casts the fp8 cache to the query's
dtype without applying scales, so logits are checked here with the default scale 1.0; its GPU
backends read `layer.k_scale` / `v_scale`, which is what the scale test checks."""

from __future__ import annotations

import shutil

import pytest
import torch

NUM_LAYERS = 2  # conftest's tiny Llama


def test_flag_reaches_atoms_config(tiny_llama, make_server_args, model_config):
    from atom_sglang_plugin.config import AtomSglangConfig

    for name in ("fp8_e4m3", "auto"):
        args = make_server_args(tiny_llama[0], model_impl="atom", kv_cache_dtype=name)
        config = AtomSglangConfig.from_sglang(args, model_config(tiny_llama[0]))
        assert config.kv_cache_dtype == name
        assert f"kv_cache_dtype={name}" in config.summary()


def _load(sglang_runtime, model_dir, model_config):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import get_model

    return get_model(model_config=model_config(model_dir, model_impl="atom"),
                     load_config=LoadConfig(), device_config=DeviceConfig("cpu"))  # fmt: skip


def test_checkpoint_scales_reach_radix_attention(
    sglang_runtime, tiny_llama, model_config, tmp_path
):
    from safetensors.torch import load_file, save_file
    from sglang.srt.layers.radix_attention import RadixAttention

    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_llama[0], scaled)
    (file,) = scaled.glob("*.safetensors")
    tensors = load_file(file)
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0625)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.125)
    tensors["model.layers.1.self_attn.k_proj.output_scale"] = torch.tensor([0.25])
    save_file(tensors, file, metadata={"format": "pt"})  # layer 1's v: none (1.0)

    model = _load(sglang_runtime, scaled, model_config)
    radix = [m for m in model.modules() if isinstance(m, RadixAttention)]
    assert [(m.k_scale_float, m.v_scale_float) for m in radix] == [(0.0625, 0.125), (0.25, None)]
    assert float(radix[0].k_scale) == 0.0625 and radix[0].k_scale.dtype == torch.float32
    assert float(radix[1].k_scale) == 0.25 and radix[1].v_scale is None  # SGLang's 1.0

    bad = load_file(file)
    bad["model.layers.1.self_attn.v_scale"] = torch.ones(2)
    save_file(bad, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"v_scale must be one per-tensor value, got shape \(2,\)"):
        _load(sglang_runtime, scaled, model_config)


def test_fp8_pool_logits_within_tolerance_of_transformers(
    sglang_runtime, tiny_llama, model_config, sglang_batches
):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    model = _load(sglang_runtime, tiny_llama[0], model_config)
    reference = tiny_llama[1]
    pool = MHATokenToKVPool(size=512, page_size=1, dtype=torch.float8_e4m3fn, head_num=2,
                            head_dim=16, layer_num=NUM_LAYERS, device="cpu",
                            enable_memory_saver=False)  # fmt: skip
    assert pool.get_key_buffer(0).dtype == torch.float8_e4m3fn
    batches = sglang_batches(pool)
    prompts = [[1, 5, 9, 33, 70, 2, 11], [7, 8, 200, 3], [42]]
    out = batches.run(model, batches.extend(prompts))
    worst = 0.0
    for step in range(4):
        with torch.no_grad():
            expected = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
        worst = max(worst, float((out.next_token_logits - expected).abs().max()))
        worst_relative = worst / float(expected.abs().max())
        if step == 3:
            break
        tokens = expected.argmax(-1).tolist()  # teacher-forced with transformers' greedy tokens
        prompts = [p + [t] for p, t in zip(prompts, tokens, strict=True)]
        out = batches.run(model, batches.decode(tokens))
    print(f"fp8 pool under SGLang: max |logit diff| {worst:.4f} ({worst_relative:.4f} of max)")
    # Prefill logits attend over the fresh fp32 K/V, decode steps over the fp8 pool: within fp8
    # e4m3's rounding (1/16 relative per cached value); 0.05 of max |logit| as in atom-models'
    # fp8 cache test.
    assert 0 < worst_relative <= 0.05
