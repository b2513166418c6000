"""SGLang's own model-loading code under `--model-impl atom`: which class its lookup returns, the
model its loader builds (RadixAttention layers, every checkpoint tensor loaded), and the logits
of a prefill and a decode step through SGLang's torch-native attention backend over its own
`ForwardBatch` and KV-cache pools, against `transformers`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

NUM_LAYERS = 2  # conftest's tiny Llama: 2 layers, 4 query heads over 2 KV heads of size 16


def test_model_impl_atom_selects_atoms_wrapper(sglang_plugins, tiny_llama, model_config):
    from sglang.srt.model_loader.utils import get_model_architecture, get_resolved_model_impl

    from atom_sglang_plugin.model import AtomForCausalLM

    config = model_config(tiny_llama[0], model_impl="atom")
    assert get_model_architecture(config) == (AtomForCausalLM, "LlamaForCausalLM")
    assert get_resolved_model_impl(config).value == "sglang"  # SGLang's native model contract


@pytest.mark.parametrize("impl", ["auto", "sglang"])
def test_other_model_impl_leaves_sglang_untouched(sglang_plugins, tiny_llama, model_config, impl):
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.models.llama import LlamaForCausalLM

    config = model_config(tiny_llama[0], model_impl=impl)
    assert get_model_architecture(config) == (LlamaForCausalLM, "LlamaForCausalLM")


def test_unsupported_architecture_falls_back_to_sglang(sglang_plugins):
    from atom_sglang_plugin.activation import select_model_architecture

    hf_config = SimpleNamespace(architectures=["GPT2LMHeadModel"])
    config = SimpleNamespace(model_impl="atom", hf_config=hf_config)
    answer = select_model_architecture(lambda c: ("sglang's lookup", c), config)
    assert answer == ("sglang's lookup", config)


@pytest.fixture(scope="module")
def loaded(sglang_runtime, tiny_llama, model_config):
    """ATOM's model as SGLang's loader builds it, and the names its `load_weights` loaded."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader import get_model

    from atom_sglang_plugin.model import AtomForCausalLM

    loaded_names: list[set[str]] = []
    original = AtomForCausalLM.load_weights

    def recording(self, weights):
        names = original(self, weights)
        loaded_names.append(names)
        return names

    AtomForCausalLM.load_weights = recording
    try:
        model = get_model(model_config=model_config(tiny_llama[0], model_impl="atom"),
                          load_config=LoadConfig(), device_config=DeviceConfig("cpu"))  # fmt: skip
    finally:
        AtomForCausalLM.load_weights = original
    return model, loaded_names


def test_loader_builds_atom_model_with_radix_attention(loaded):
    from sglang.srt.layers.radix_attention import RadixAttention

    from atom_models.models.llama import LlamaForCausalLM as AtomLlama
    from atom_sglang_plugin.model import AtomForCausalLM

    model, _ = loaded
    assert type(model) is AtomForCausalLM
    assert isinstance(model.model, AtomLlama)
    radix = [m for m in model.modules() if isinstance(m, RadixAttention)]
    assert [m.layer_id for m in radix] == list(range(NUM_LAYERS))
    assert (radix[0].tp_q_head_num, radix[0].tp_k_head_num, radix[0].head_dim) == (4, 2, 16)
    assert model.get_attention_sliding_window_size() is None  # Llama: full attention


def test_every_parameter_loaded(loaded, tiny_llama):
    model, loaded_names = loaded
    assert len(loaded_names) == 1, "SGLang's loader calls load_weights once"
    params = {f"model.{name}" for name, _ in model.model.named_parameters()}
    assert loaded_names[0] == params
    # The values are the checkpoint's: q/k/v and gate/up are packed, the rest load by name.
    reference = dict(tiny_llama[1].named_parameters())
    ours = dict(model.model.named_parameters())
    assert torch.equal(ours["model.embed_tokens.weight"], reference["model.embed_tokens.weight"])
    q, k, v = (reference[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv")
    assert torch.equal(ours["model.layers.1.self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
    assert torch.equal(ours["lm_head.weight"], reference["lm_head.weight"])


def test_prefill_and_decode_logits_match_transformers(loaded, tiny_llama, sglang_batches):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    model, _ = loaded
    reference = tiny_llama[1]
    prompts = [[1, 5, 9, 33, 70, 2, 11], [7, 8, 200, 3], [42]]
    batches = sglang_batches(
        MHATokenToKVPool(size=512, page_size=1, dtype=torch.float32, head_num=2, head_dim=16,
                         layer_num=NUM_LAYERS, device="cpu", enable_memory_saver=False)
    )  # fmt: skip

    out = batches.run(model, batches.extend(prompts))
    assert isinstance(out, LogitsProcessorOutput)
    with torch.no_grad():
        expected = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
    torch.testing.assert_close(out.next_token_logits, expected, rtol=1e-4, atol=1e-4)

    # Two decode steps over the cached prefixes, feeding back the greedy tokens.
    for _ in range(2):
        tokens = out.next_token_logits.argmax(-1).tolist()
        prompts = [p + [t] for p, t in zip(prompts, tokens, strict=True)]
        out = batches.run(model, batches.decode(tokens))
        with torch.no_grad():
            expected = torch.stack([reference(torch.tensor([p])).logits[0, -1] for p in prompts])
        torch.testing.assert_close(out.next_token_logits, expected, rtol=1e-4, atol=1e-4)
