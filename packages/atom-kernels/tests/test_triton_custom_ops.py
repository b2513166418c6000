"""The Triton ops as torch custom ops: registered in the registry and under torch.ops.atom, with
schemas that match what they mutate and fake implementations that match their outputs
(``torch.library.opcheck``), so torch.compile and CUDA-graph capture can hold them."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import atom_kernels as ak
from atom_kernels import registry

OPS = [
    "rms_norm",
    "fused_add_rms_norm",
    "fused_add_rms_norm_",
    "rotary_embedding",
    "rotary_embedding_and_cache",
    "silu_and_mul",
    "gelu_and_mul",
    "reshape_and_cache",
    "paged_attention",
    "mla_cache_write",
    "mla_paged_attention",
]
# Kernels behind plain-function ops (they route part of their work to torch): op -> custom op.
KERNEL_OPS = {"linear": "skinny_linear", "sample": "sample"}


def test_every_triton_op_is_registered(triton_backend):
    assert set(OPS) <= set(registry.registered_ops("triton"))
    for name in OPS:
        assert registry._IMPLS["triton"][name] is triton_backend.custom_ops.ENTRIES[name]
        assert hasattr(torch.ops.atom, f"triton_{name}")
    for name in ("linear", "sample", "fused_moe"):
        assert registry._IMPLS["triton"][name] is triton_backend.custom_ops.ENTRIES[name]
    for kernel in KERNEL_OPS.values():
        assert hasattr(torch.ops.atom, f"triton_{kernel}")


def test_entries_direct_in_eager_custom_op_under_compile(triton_backend, monkeypatch):
    """The registry's entry calls the Triton host code directly in eager code and the custom op
    under torch.compile (one opaque node in the traced graph); both give the same result as the
    custom op called in eager."""
    custom_ops = triton_backend.custom_ops
    device = triton_backend.device
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g).to(device)
    weight = torch.randn(64, generator=g).to(device)
    expected = custom_ops.rms_norm(x, weight, 1e-6)
    entry = custom_ops.ENTRIES["rms_norm"]

    class Dispatched(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Dispatched() as seen:
        out = entry(x, weight, 1e-6)
    assert not any("atom" in op for op in seen.ops)  # direct: no custom-op dispatch
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    monkeypatch.setattr(custom_ops, "DIRECT_EAGER", False)
    with Dispatched() as seen:
        entry(x, weight, 1e-6)
    assert "atom.triton_rms_norm.default" in seen.ops
    monkeypatch.undo()

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(lambda a, w: entry(a, w, 1e-6), backend=backend, fullgraph=True)(x, weight)
    targets = [node.target for gm in graphs for node in gm.graph.nodes]
    assert torch.ops.atom.triton_rms_norm.default in targets
    torch.testing.assert_close(out, expected)


def _cases(device):
    g = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(device)

    x, weight = randn(3, 32), randn(32) + 1
    cache = ak.rope_cos_sin_cache(16, 64, 10000.0).to(device)
    positions = torch.tensor([3, 0, 63], device=device)
    key_cache, value_cache = randn(4, 8, 2, 16), randn(4, 8, 2, 16)
    slots = torch.tensor([5, -1, 30], device=device)
    block_tables = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=device)
    seq_lens = torch.tensor([10, 7], dtype=torch.int32, device=device)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    scale_t = torch.tensor([0.5], device=device)
    query, out = randn(4, 4, 16), randn(4, 4, 16)
    latent_cache = randn(4, 8, 40 + 8)  # MLA: L = 40, R = 8
    ops = torch.ops.atom
    return {
        "rms_norm": (ops.triton_rms_norm, (x, weight, 1e-6)),
        "fused_add_rms_norm": (ops.triton_fused_add_rms_norm, (x, randn(3, 32), weight, 1e-6)),
        "fused_add_rms_norm_": (
            ops.triton_fused_add_rms_norm_,
            (x.clone(), randn(3, 32), weight, 1e-6),
        ),
        "rotary_embedding": (
            ops.triton_rotary_embedding,
            (positions, randn(3, 2, 16), randn(3, 1, 16), cache, True),
        ),
        "rotary_embedding_and_cache": (
            ops.triton_rotary_embedding_and_cache,
            (
                positions,
                randn(3, 2, 16),
                randn(3, 2, 16),
                randn(3, 2, 16),
                cache,
                True,
                key_cache.clone(),
                value_cache.clone(),
                slots,
                None,
                None,
                scale_t,
                None,
                randn(16),
                randn(16),
                1e-6,
            ),
        ),  # fmt: skip
        "silu_and_mul": (ops.triton_silu_and_mul, (x,)),
        "gelu_and_mul": (ops.triton_gelu_and_mul, (x, "tanh")),
        "reshape_and_cache": (
            ops.triton_reshape_and_cache,
            (
                randn(3, 2, 16),
                randn(3, 2, 16),
                key_cache.clone(),
                value_cache.clone(),
                slots,
                scale_t,
                None,
                None,
                0.25,
            ),
        ),  # fmt: skip
        "paged_attention": (
            ops.triton_paged_attention,
            (
                query,
                key_cache,
                value_cache,
                block_tables,
                seq_lens,
                qsl,
                0.25,
                4,
                randn(4),
                None,
                None,
                None,
                None,
                None,
                out,
            ),
        ),  # fmt: skip
        "mla_cache_write": (
            ops.triton_mla_cache_write,
            (randn(3, 40), randn(3, 8), latent_cache.clone(), slots),
        ),
        "mla_paged_attention": (
            ops.triton_mla_paged_attention,
            (
                randn(4, 5, 40),
                randn(4, 5, 8),
                latent_cache,
                block_tables,
                seq_lens,
                qsl,
                0.25,
                randn(4, 5, 40),
                None,
            ),
        ),  # fmt: skip
        "skinny_linear": (ops.triton_skinny_linear, (randn(3, 32), randn(40, 32), randn(40))),
        "sample": (
            ops.triton_sample,
            (randn(3, 50, dtype=torch.float32), torch.ones(3).to(device)),
        ),
    }


@pytest.mark.parametrize("name", OPS + list(KERNEL_OPS.values()))
def test_opcheck(triton_backend, name):
    op, args = _cases(triton_backend.device)[name]
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
