"""One rank of the tensor-parallel test (run as a script by test_tensor_parallel.py).

Builds the model sharded over a gloo group, checks this rank's shards against the full checkpoint,
runs prompts through the paged cache and saves the logits for the test to compare.
"""

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from atom_models import load_model, set_forward_context
from atom_models.distributed import TPGroup
from atom_models.native_host import (
    NativeMLAAttention,
    PagedAttentionMetadata,
    bind_kv_cache,
    set_mla_mode,
)
from atom_models.weights import iter_safetensors


class FusingTPGroup(TPGroup):
    """A group that takes the decoder layers' post-attention all-reduce with the residual add
    and norm (as the engine's peer all-reduce does on GPUs), here as all-reduce then the op."""

    fuses_all_reduce_norm = True
    fused_calls = 0

    def all_reduce_add_rms_norm(self, x, residual, weight, eps):
        import atom_kernels

        self.fused_calls += 1
        return atom_kernels.fused_add_rms_norm(self.all_reduce(x), residual, weight, eps)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (float8 tensors have no torch.equal on CPU)."""
    if a.dtype.itemsize == 1:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--fuse-norm", action="store_true", help="a FusingTPGroup")
    args = parser.parse_args()
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=args.rank,
        world_size=args.world_size,
    )
    # Heads that do not split over the ranks are padded with zero heads (as the engine's group).
    group_cls = FusingTPGroup if args.fuse_norm else TPGroup
    tp = group_cls(dist.group.WORLD, pad_attention_heads=True)
    model = load_model(args.checkpoint, dtype=torch.float32, tp=tp)
    layers = model.model.layers[: model.model.num_hidden_layers]
    deferred = [not layer.self_attn.o_proj.reduce_results for layer in layers]
    assert all(deferred) if args.fuse_norm else not any(deferred), deferred
    full = dict(iter_safetensors(args.checkpoint))
    attn = model.model.layers[0].self_attn
    if "weight" not in getattr(attn, "o_proj", attn)._parameters:
        pass  # integer checkpoints: repacked at load; the logits below check the shards
    elif hasattr(attn, "qkv_proj"):
        # This rank's q heads: the checkpoint's rows src..src+rows, then zero (dummy) heads.
        _, src, rows, _ = attn.qkv_proj.row_plan("q")
        heads = attn.qkv_proj.num_heads * attn.qkv_proj.head_size
        q_rows = full["model.layers.0.self_attn.q_proj.weight"][src : src + rows]
        assert same(attn.qkv_proj.weight[:rows], q_rows), "q shard is not this rank's"
        assert not attn.qkv_proj.weight[rows:heads].float().any(), "dummy q heads are not zero"
        scale = getattr(attn.qkv_proj, "weight_scale_inv", None)
        if scale is not None:  # block FP8: the scale grid's rows split with the weight's
            bn = scale.block[0]
            q_scale = full["model.layers.0.self_attn.q_proj.weight_scale_inv"]
            n = -(-rows // bn)
            assert same(scale[:n], q_scale[src // bn : src // bn + n])
    else:  # MLA: kv_b_proj split by heads
        rows = attn.kv_b_proj.weight.shape[0]
        kv_b = full["model.layers.0.self_attn.kv_b_proj.weight"]
        assert torch.equal(attn.kv_b_proj.weight, kv_b[args.rank * rows : (args.rank + 1) * rows])
    o_src, o_cols, _ = attn.o_proj.col_plan()
    o_full = full.get("model.layers.0.self_attn.o_proj.weight")
    if o_full is not None:
        assert same(attn.o_proj.weight[:, :o_cols], o_full[:, o_src : o_src + o_cols])
        assert not attn.o_proj.weight[:, o_cols:].float().any(), "dummy heads' o_proj not zero"
    scale = getattr(attn.o_proj, "weight_scale_inv", None)
    if scale is not None:  # block FP8: the scale grid's columns split with the weight's
        bk = scale.block[1]
        o_scale = full["model.layers.0.self_attn.o_proj.weight_scale_inv"]
        n = -(-o_cols // bk)
        assert same(scale[:, :n], o_scale[:, o_src // bk : o_src // bk + n])

    batch = torch.load(args.prompts)
    block_size, tables, next_block = 4, [], 0
    for tokens in batch:
        n = -(-len(tokens) // block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    bind_kv_cache(model, next_block, block_size, torch.float32, "cpu")
    lens = [len(t) for t in batch]
    md = PagedAttentionMetadata.build(lens, lens, tables, block_size)
    ids = torch.tensor([tok for t in batch for tok in t])
    positions = torch.tensor([p for t in batch for p in range(len(t))])
    with torch.no_grad(), set_forward_context(md):
        logits = model.compute_logits(model(ids, positions))
    if args.fuse_norm:
        assert tp.fused_calls == len(layers), (tp.fused_calls, len(layers))
    if getattr(model, "num_mtp_layers", 0):
        # The MTP drafter over this rank's shards, from the model's own hidden states.
        bind_kv_cache(model, next_block, block_size, torch.float32, "cpu")
        with torch.no_grad(), set_forward_context(md):
            hidden = model.mtp_forward(ids, positions, model(ids, positions))
            torch.save(model.compute_mtp_logits(hidden), Path(args.out).with_suffix(".mtp.pt"))
    if any(isinstance(m, NativeMLAAttention) for m in model.modules()):
        # MLA: the absorbed formulation over this rank's heads gives the same logits.
        bind_kv_cache(model, next_block, block_size, torch.float32, "cpu")
        set_mla_mode(model, "absorbed")
        with torch.no_grad(), set_forward_context(md):
            absorbed = model.compute_logits(model(ids, positions))
        assert (absorbed - logits).abs().max() < 1e-4, "absorbed MLA differs from expanded"
    torch.save(logits, Path(args.out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # NOTE: a gloo rank sometimes aborted at interpreter exit ("terminate called without an active
    # exception", SIGABRT) after its work and teardown were done (seen once in CI on 2 cores):
    # a joinable C++ thread destroyed by static destructors. Leave without running them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
