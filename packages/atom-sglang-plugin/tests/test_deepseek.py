"""DeepSeek-V3 under `--model-impl atom`: SGLang's loader builds ATOM's model with its multi-head
latent attention on RadixAttention (one KV head of kv_lora_rank + qk_rope_head_dim, values of
kv_lora_rank: SGLang's MLA layout), loads every tensor of a tiny checkpoint saved by transformers,
and a prefill and two decode steps over SGLang's MLA KV pool and torch-native backend give
transformers' logits."""

from __future__ import annotations

import pytest
import torch

NUM_LAYERS, KV_LORA_RANK, ROPE_DIM = 2, 32, 8


@pytest.fixture(scope="module")
def deepseek(sglang_runtime, tmp_path_factory, model_config):
    """(ATOM's model as SGLang's loader builds it, the float32 transformers model)."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import get_model
    from transformers import DeepseekV3Config

    from atom_models.testing import save_random_checkpoint

    config = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, tie_word_embeddings=False, n_routed_experts=8,
        num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, q_lora_rank=24,
        kv_lora_rank=KV_LORA_RANK, qk_nope_head_dim=16, qk_rope_head_dim=ROPE_DIM,
        v_head_dim=24, topk_method="noaux_tc", scoring_func="sigmoid",
        architectures=["DeepseekV3ForCausalLM"],
    )  # fmt: skip
    path = tmp_path_factory.mktemp("deepseek-v3")
    reference = save_random_checkpoint(config, path)
    model = get_model(model_config=model_config(path, model_impl="atom"),
                      load_config=LoadConfig(), device_config=DeviceConfig("cpu"))  # fmt: skip
    return model, reference


def test_loader_builds_atom_deepseek_on_radix_attention(deepseek):
    from sglang.srt.layers.radix_attention import RadixAttention

    from atom_models.models.deepseek_v3 import DeepseekV3ForCausalLM
    from atom_sglang_plugin.model import AtomForCausalLM

    model, _ = deepseek
    assert type(model) is AtomForCausalLM
    assert isinstance(model.model, DeepseekV3ForCausalLM)
    radix = [m for m in model.modules() if isinstance(m, RadixAttention)]
    assert [m.layer_id for m in radix] == list(range(NUM_LAYERS))
    layer = radix[0]
    assert (layer.tp_q_head_num, layer.tp_k_head_num) == (4, 1)
    assert (layer.head_dim, layer.v_head_dim) == (KV_LORA_RANK + ROPE_DIM, KV_LORA_RANK)


def test_prefill_and_decode_logits_match_transformers(deepseek, sglang_batches):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    model, reference = deepseek
    pool = MLATokenToKVPool(size=512, page_size=1, dtype=torch.float32,
                            kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM,
                            layer_num=NUM_LAYERS, device="cpu",
                            enable_memory_saver=False)  # fmt: skip
    batches = sglang_batches(pool)
    prompts = [[1, 5, 9, 33, 70, 2, 11], [7, 8, 200, 3], [42]]
    out = batches.run(model, batches.extend(prompts))
    with torch.no_grad():
        expected = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(out.next_token_logits, expected, rtol=1e-4, atol=1e-4)
    for _ in range(2):
        tokens = out.next_token_logits.argmax(-1).tolist()
        prompts = [p + [t] for p, t in zip(prompts, tokens, strict=True)]
        out = batches.run(model, batches.decode(tokens))
        with torch.no_grad():
            expected = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
        torch.testing.assert_close(out.next_token_logits, expected, rtol=1e-4, atol=1e-4)
