"""Loading a quantized checkpoint keeps it quantized: no copy in the activation dtype.

A quantized Llama (block FP8 ~180 MB; compressed-tensors W4A16 ~90 MB and W8A8 ~180 MB) is loaded
in bf16 in a fresh process, which samples its private (anonymous) resident memory every
millisecond. The peak growth must stay below the quantized size
plus one decoder layer in bf16 (the issue's bound); a bf16 copy of the weights would be twice the
quantized size. File-backed pages of the memory-mapped checkpoint are the page cache, shared and
reclaimable, and are reported separately (VmHWM counts them).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

H, INTER, LAYERS, VOCAB = 1024, 8192, 6, 512
LINEARS = {
    "self_attn.q_proj": (H, H),
    "self_attn.k_proj": (H, H),
    "self_attn.v_proj": (H, H),
    "self_attn.o_proj": (H, H),
    "mlp.gate_proj": (INTER, H),
    "mlp.up_proj": (INTER, H),
    "mlp.down_proj": (H, INTER),
}

MEASURE = r"""
import json, sys, threading, time
import torch
from atom_models import load_model

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

load_model(sys.argv[2], dtype=torch.bfloat16)  # warm-up: imports and first-op initialization
peak, done = [0], threading.Event()

def sample():
    while not done.is_set():
        peak[0] = max(peak[0], kib("RssAnon"))
        time.sleep(0.001)

base = kib("RssAnon")
thread = threading.Thread(target=sample)
thread.start()
model = load_model(sys.argv[1], dtype=torch.bfloat16)
done.set()
thread.join()
peak[0] = max(peak[0], kib("RssAnon"))
dtypes = sorted({str(p.dtype) for p in model.parameters()})
print(json.dumps({"base": base, "peak": peak[0], "hwm": kib("VmHWM"), "dtypes": dtypes}))
"""


def fp8_block(rows: int, cols: int, gen) -> dict[str, torch.Tensor]:
    grid = (math.ceil(rows / 128), math.ceil(cols / 128))
    weight = torch.randn(rows, cols, generator=gen).to(torch.float8_e4m3fn)
    return {"weight": weight, "weight_scale_inv": torch.full(grid, 0.01)}


def w4a16(rows: int, cols: int, gen) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized, 4 bits, group 128, symmetric: any int32 word is 8
    valid unsigned values."""
    packed = torch.randint(-(2**31), 2**31 - 1, (rows, cols // 8), generator=gen, dtype=torch.int32)
    return {
        "weight_packed": packed,
        "weight_scale": torch.full((rows, cols // 128), 0.01).bfloat16(),
        "weight_shape": torch.tensor([rows, cols]),
    }


def w8a8(rows: int, cols: int, gen) -> dict[str, torch.Tensor]:
    """compressed-tensors int-quantized: int8 weights, a float32 scale per channel."""
    weight = torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8)
    return {"weight": weight, "weight_scale": torch.full((rows, 1), 0.01)}


def ct_config(weights: dict, activations: dict | None = None) -> dict:
    group = {"targets": ["Linear"], "weights": dict(type="int", symmetric=True, **weights)}
    if activations:
        group["input_activations"] = activations
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized" if activations else "pack-quantized",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


FORMATS = {
    # name: (tensors of one quantized linear, quantization_config, the weights' dtype once loaded)
    "fp8-block": (
        fp8_block,
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
        "torch.float8_e4m3fn",
    ),
    "w4a16": (
        w4a16,
        ct_config(dict(num_bits=4, strategy="group", group_size=128)),
        "torch.int32",
    ),
    "w8a8": (
        w8a8,
        ct_config(
            dict(num_bits=8, strategy="channel"),
            dict(num_bits=8, type="int", strategy="token", symmetric=True, dynamic=True),
        ),
        "torch.int8",
    ),
}


def write_llama(path, fmt: str, layers: int, hidden: int, inter: int) -> int:
    """A quantized Llama checkpoint (random values) in format `fmt`; returns its size in bytes."""
    linear, quant_config, _ = FORMATS[fmt]
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    ).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    config["quantization_config"] = quant_config
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(VOCAB, hidden, generator=gen).bfloat16(),
        "lm_head.weight": torch.randn(VOCAB, hidden, generator=gen).bfloat16(),
        "model.norm.weight": torch.ones(hidden).bfloat16(),
    }
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        for name, (rows, cols) in LINEARS.items():
            rows = inter if rows == INTER else hidden
            cols = inter if cols == INTER else hidden
            for suffix, t in linear(rows, cols, gen).items():
                tensors[f"{prefix}{name}.{suffix}"] = t
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{prefix}{norm}.weight"] = torch.ones(hidden).bfloat16()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())


@pytest.mark.parametrize("fmt", FORMATS)
def test_load_peak_is_quantized_size_plus_one_layer(fmt, tmp_path):
    size = write_llama(tmp_path / "big", fmt, LAYERS, H, INTER)
    write_llama(tmp_path / "warmup", fmt, 1, 256, 512)
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "big"), str(tmp_path / "warmup")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert FORMATS[fmt][2] in result["dtypes"]
    layer_bf16 = sum(r * c for r, c in LINEARS.values()) * 2
    growth = result["peak"] - result["base"]
    print(
        f"{fmt}: quantized {size / 2**20:.0f} MiB, one layer in bf16 {layer_bf16 / 2**20:.0f} "
        f"MiB, peak private growth {growth / 2**20:.0f} MiB (VmHWM {result['hwm'] / 2**20:.0f} MiB)"
    )
    assert growth < size + layer_bf16, (growth, size, layer_bf16)


def test_processing_twice_changes_nothing(tmp_path):
    """Hosts (SGLang's loader) may call a layer's process_weights_after_loading again: per-tensor
    scales, expanded to rows the first time, must not be expanded again."""
    from atom_models import load_model
    from atom_models.quantization import process_weights_after_loading
    from atom_models.testing import (
        fp8_tensor_quantize,
        save_random_checkpoint,
        write_quantized_checkpoint,
    )

    config = LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    save_random_checkpoint(config, tmp_path / "src")

    def quantize(name, tensor):
        q, scale = fp8_tensor_quantize(tensor)
        return {name: q, name.replace(".weight", ".weight_scale"): scale}

    quant_config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    path = write_quantized_checkpoint(tmp_path / "src", tmp_path / "fp8", quant_config, quantize)
    model = load_model(path)
    before = {n: p.clone() for n, p in model.named_parameters() if p.dtype == torch.float32}
    process_weights_after_loading(model)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[n], p) for n, p in before.items())
    assert after["model.layers.0.self_attn.qkv_proj.weight_scale"].shape == (64 + 2 * 32,)
