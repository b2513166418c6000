"""One attention layer call of ATOM's CPU engine path, in microseconds (issue 21).

SmolLM2-135M's attention (9 query heads, 3 KV heads, head size 64, float32), 30 layers each with
its own paged cache, a decode step at batch 1 and 8 over a context of `--context` tokens, 1 torch
thread. Each timed step is a new `PagedAttentionMetadata` (as the engine's runner builds one per
step, outside the timer) and one call of every layer, through:

- `checked`: `atom_kernels.reshape_and_cache` + `atom_kernels.paged_attention`, the public,
  checked ops (what `NativeAttention.forward_eager` called every layer before the fast path);
- `layer`: `NativeAttention.forward_eager` (checks once per step, then the step's `DecodeStep`
  at decode-only steps, the backend's ops otherwise);
- `op`: the custom op the compiled model calls, `torch.ops.atom.native_attention`.

The modes alternate step by step; the median step over 30 layers is reported per layer, then a
cProfile top list of each mode.

    uv run python benchmarks/cpu_attention_call.py --steps 200
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time

import torch

import atom_kernels
from atom_models.forward_context import set_forward_context
from atom_models.layers.attention import AttentionSpec
from atom_models.native_host import NativeAttention, PagedAttentionMetadata

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 30, 9, 3, 64, 16


def build_layers(num_blocks: int) -> list[NativeAttention]:
    layers = []
    for i in range(NUM_LAYERS):
        spec = AttentionSpec(NUM_HEADS, HEAD_SIZE, HEAD_SIZE**-0.5, NUM_KV_HEADS, i, f"l{i}")
        layer = NativeAttention(spec)
        layer.bind_cache(num_blocks, BLOCK_SIZE, torch.float32, "cpu")
        for cache in (layer.k_cache, layer.v_cache):
            cache.normal_()
        layers.append(layer)
    return layers


def checked(layer: NativeAttention, md: PagedAttentionMetadata, q, k, v) -> torch.Tensor:
    """The layer body through the public ops (forward_eager before the fast path)."""
    spec, num_tokens = layer.spec, q.shape[0]
    q = q.view(num_tokens, spec.num_heads, spec.head_size)
    k = k.view(num_tokens, spec.num_kv_heads, spec.head_size)
    v = v.view(num_tokens, spec.num_kv_heads, -1)
    atom_kernels.reshape_and_cache(k, v, layer.k_cache, layer.v_cache, md.slot_mapping)
    out = atom_kernels.paged_attention(
        q, layer.k_cache, layer.v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
        spec.scale, sliding_window=spec.sliding_window, soft_cap=spec.soft_cap,
        max_query_len=md.max_query_len,
    )  # fmt: skip
    return out.reshape(num_tokens, -1)


MODES = {
    "checked": checked,
    "layer": lambda layer, md, q, k, v: layer.forward_eager(q, k, v, None),
    "op": lambda layer, md, q, k, v: torch.ops.atom.native_attention(q, k, v, None, layer.layer_id),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"load {os.getloadavg()}, torch {torch.__version__}, 1 thread")
    blocks_per_seq = -(-args.context // BLOCK_SIZE)
    for batch in args.batches:
        layers = build_layers(batch * blocks_per_seq + 1)
        tables = [list(range(b * blocks_per_seq, (b + 1) * blocks_per_seq)) for b in range(batch)]
        q = torch.randn(batch, NUM_HEADS * HEAD_SIZE)
        k = torch.randn(batch, NUM_KV_HEADS * HEAD_SIZE)
        v = torch.randn(batch, NUM_KV_HEADS * HEAD_SIZE)

        def step(fn, batch=batch, tables=tables, layers=layers, q=q, k=k, v=v) -> float:
            md = PagedAttentionMetadata.build(
                [args.context] * batch, [1] * batch, tables, BLOCK_SIZE
            )
            with set_forward_context(md):
                start = time.perf_counter()
                for layer in layers:
                    fn(layer, md, q, k, v)
                return time.perf_counter() - start

        outs = {}
        for name, fn in MODES.items():  # warm-up, and the outputs agree
            md = PagedAttentionMetadata.build([args.context] * batch, [1] * batch, tables, 16)
            with set_forward_context(md):
                outs[name] = fn(layers[0], md, q, k, v)
        for name in MODES:
            torch.testing.assert_close(outs[name], outs["checked"], rtol=0, atol=0)
        times: dict[str, list[float]] = {name: [] for name in MODES}
        for _ in range(args.steps):
            for name, fn in MODES.items():
                times[name].append(step(fn))
        per_layer = {n: statistics.median(t) / NUM_LAYERS * 1e6 for n, t in times.items()}
        print(
            f"batch {batch}, context {args.context}: us per layer call (median of {args.steps} "
            "steps, alternating): "
            + ", ".join(f"{n} {us:.1f}" for n, us in per_layer.items())
            + f"; checked / layer {per_layer['checked'] / per_layer['layer']:.2f}x, "
            f"load {os.getloadavg()[0]:.2f}"
        )
        for name, fn in MODES.items():
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(20):
                step(fn)
            profile.disable()
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
            print(f"--- cProfile, {name}, batch {batch}, 20 steps, by own time")
            print("\n".join(text.getvalue().splitlines()[6:22]))


if __name__ == "__main__":
    main()
