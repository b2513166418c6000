"""The piecewise CUDA graphs' parts that run without a GPU: the capture ladder, the attention
seam they cut the forward at (`intercept_attention`), and the `cudagraph_mode` setting. The
graphs themselves are tested on the GPU (test_gpu_engine.py, test_moe_engine.py and
test_deepseek_engine.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from atom_engine import EngineConfig
from atom_engine.cli.args import engine_config_from_args
from atom_engine.cli.main import build_parser
from atom_engine.graphs.piecewise import capture_sizes
from atom_models import load_model, set_forward_context
from atom_models.native_host import (
    PagedAttentionMetadata,
    bind_kv_cache,
    intercept_attention,
)
from atom_models.testing import save_random_checkpoint


def test_capture_sizes_cover_the_budget_without_padding_a_full_step():
    sizes = capture_sizes(2048)
    assert sizes == sorted(set(sizes)) and sizes[0] == 16 and sizes[-1] == 2048
    assert [s for s in sizes if s > 512] == [768, 1024, 1280, 1536, 1792, 2048]
    # Padding: under 16 tokens below 64, at most 25% up to 512, at most 255 tokens above.
    for t in range(1, 2049):
        padded = next(s for s in sizes if s >= t)
        assert padded - t <= (15 if t <= 64 else t // 4 if t <= 512 else 255), t
    assert capture_sizes(100) == [16, 32, 48, 64, 80, 96, 100]
    assert capture_sizes(8192)[-3:] == [7168, 7680, 8192]
    assert capture_sizes(16) == [16] and capture_sizes(5) == [5]


def test_cudagraph_mode_is_checked_and_is_a_flag():
    with pytest.raises(ValueError, match="cudagraph_mode must be one of full, full_and_piecewise"):
        EngineConfig(cudagraph_mode="piecewise_only")
    assert EngineConfig().cudagraph_mode == "full"
    args = build_parser().parse_args(["serve", "--cudagraph-mode", "full_decode_only"])
    assert engine_config_from_args(args).cudagraph_mode == "full_decode_only"
    args = build_parser().parse_args(["serve", "--cudagraph-mode", "full"])
    assert engine_config_from_args(args).cudagraph_mode == "full"


def test_whole_forward_graphs_only_for_models_whose_attention_reads_device_metadata(tmp_path):
    """`cudagraph_mode="full"` captures the steps with a prefill whole only when every cache
    layer is a NativeAttention (device metadata alone); MLA (host lengths) keeps the pieces."""
    from transformers import DeepseekV3Config

    from atom_engine.graphs.mixed import supports_mixed_graphs

    qwen3 = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    save_random_checkpoint(qwen3, tmp_path / "qwen3", seed=5)
    assert supports_mixed_graphs(load_model(tmp_path / "qwen3"))
    deepseek = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        max_position_embeddings=256,
    )  # fmt: skip
    save_random_checkpoint(deepseek, tmp_path / "deepseek", seed=5)
    assert not supports_mixed_graphs(load_model(tmp_path / "deepseek"))


@torch.no_grad()
def test_intercept_attention_sees_every_layer_in_order_with_per_token_tensors(tmp_path):
    """The seam the piecewise graphs cut at: every attention layer's call, in layer order, with
    its per-token inputs; what the interceptor returns is what the model goes on with."""
    config = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
    )  # fmt: skip
    save_random_checkpoint(config, tmp_path, seed=5)
    model = load_model(tmp_path)
    bind_kv_cache(model, 8, 16, torch.float32, "cpu")
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    md = PagedAttentionMetadata.build([20], [20], [[0, 1]], 16)
    with set_forward_context(md):
        expected = model(ids, torch.arange(20))
    calls = []

    def record(layer, args):
        calls.append((layer.spec.layer_idx, [a.shape[0] for a in args if a is not None]))
        out = torch.full((args[0].shape[0], 4 * 16), float("nan"))  # written in place
        assert layer.writes_out and layer.attend(*args, out=out).data_ptr() == out.data_ptr()
        return out

    with set_forward_context(md), intercept_attention(record):
        got = model(ids, torch.arange(20))
    torch.testing.assert_close(got, expected)
    assert calls == [(i, [20, 20, 20]) for i in range(3)]

    def zeros(layer, args):
        return torch.zeros(args[0].shape[0], 4 * 16)

    with set_forward_context(md), intercept_attention(zeros):
        changed = model(ids, torch.arange(20))
    assert not torch.allclose(changed, expected)  # the model went on with the interceptor's output
    with set_forward_context(md):  # and the seam is gone after the block
        torch.testing.assert_close(model(ids, torch.arange(20)), expected)


def test_no_collection_while_graphs_capture():
    """`_no_gc`: garbage made before the capture is collected first (its finalizers run then, not
    inside a capture), the collector is off inside and back on after, an error included."""
    import gc
    import weakref

    from atom_engine.graphs import _no_gc

    class Cycle:
        pass

    def garbage():
        a, b = Cycle(), Cycle()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        return weakref.ref(a)

    before = garbage()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), _no_gc():
        assert before() is None and not gc.isenabled()
        raise RuntimeError("a capture failed")
    assert gc.isenabled()
