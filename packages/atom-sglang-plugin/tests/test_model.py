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


class SglangBatches:
    """SGLang's KV-cache pools, its torch-native backend, and `ForwardBatch`es over them, filled
    the way SGLang's scheduler fills them (one request-to-token row per request, slot per token)."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int) -> None:
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

        self.req_to_token = ReqToTokenPool(size=8, max_context_len=128, device="cpu",
                                           enable_memory_saver=False)  # fmt: skip
        self.kv = MHATokenToKVPool(size=512, page_size=1, dtype=torch.float32, head_num=kv_heads,
                                   head_dim=head_dim, layer_num=num_layers, device="cpu",
                                   enable_memory_saver=False)  # fmt: skip
        runner = SimpleNamespace(device="cpu", req_to_token_pool=self.req_to_token,
                                 token_to_kv_pool=self.kv)  # fmt: skip
        self.backend = TorchNativeAttnBackend(runner)
        self.next_slot = 1  # slot 0 is SGLang's padding slot
        self.lens: list[int] = []

    def _slots(self, n: int) -> torch.Tensor:
        slots = torch.arange(self.next_slot, self.next_slot + n, dtype=torch.int64)
        self.next_slot += n
        return slots

    def extend(self, prompts: list[list[int]]):
        from sglang.srt.model_executor import forward_batch_info as fbi

        lens = [len(p) for p in prompts]
        slots = self._slots(sum(lens))
        starts = [sum(lens[:i]) for i in range(len(lens))]
        for i, n in enumerate(lens):
            self.req_to_token.req_to_token[i, :n] = slots[starts[i] : starts[i] + n].int()
        self.lens = lens
        no_prefix = torch.zeros(len(lens), dtype=torch.int64)
        return fbi.ForwardBatch(
            forward_mode=fbi.ForwardMode.EXTEND, batch_size=len(prompts),
            input_ids=torch.tensor(sum(prompts, [])), req_pool_indices=torch.arange(len(lens)),
            seq_lens=torch.tensor(lens), seq_lens_cpu=torch.tensor(lens), seq_lens_sum=sum(lens),
            out_cache_loc=slots, positions=torch.cat([torch.arange(n) for n in lens]),
            extend_seq_lens=torch.tensor(lens), extend_prefix_lens=no_prefix,
            extend_start_loc=torch.tensor(starts), extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[0] * len(lens), extend_num_tokens=sum(lens),
            capture_hidden_mode=fbi.CaptureHiddenMode.NULL,
        )  # fmt: skip

    def decode(self, tokens: list[int]):
        from sglang.srt.model_executor import forward_batch_info as fbi

        slots = self._slots(len(tokens))
        positions = torch.tensor(self.lens)
        for i, n in enumerate(self.lens):
            self.req_to_token.req_to_token[i, n] = int(slots[i])
        self.lens = [n + 1 for n in self.lens]
        return fbi.ForwardBatch(
            forward_mode=fbi.ForwardMode.DECODE, batch_size=len(tokens),
            input_ids=torch.tensor(tokens), req_pool_indices=torch.arange(len(tokens)),
            seq_lens=torch.tensor(self.lens), seq_lens_cpu=torch.tensor(self.lens),
            seq_lens_sum=sum(self.lens), out_cache_loc=slots, positions=positions,
            capture_hidden_mode=fbi.CaptureHiddenMode.NULL,
        )  # fmt: skip

    def run(self, model, batch):
        """One step as SGLang's model runner takes it: backend metadata, forward context."""
        from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

        self.backend.init_forward_metadata(batch)
        with forward_context(ForwardContext(attn_backend=self.backend), forward_batch=batch):
            return model.forward(batch.input_ids, batch.positions, batch)


def test_prefill_and_decode_logits_match_transformers(loaded, tiny_llama):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    model, _ = loaded
    reference = tiny_llama[1]
    prompts = [[1, 5, 9, 33, 70, 2, 11], [7, 8, 200, 3], [42]]
    batches = SglangBatches(NUM_LAYERS, 2, 16)

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
