"""Tiny random checkpoints saved by `transformers` itself, for tests without downloads.

Used by ATOM's own tests and by hosts' integration tests (vLLM, SGLang) to build checkpoints in
the exact layout Hugging Face publishes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations.

    HF's 0.02-std init makes every logit nearly zero, which would let real bugs hide under an
    absolute tolerance and turn greedy decoding into a coin toss between near-tied tokens.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif "embed" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        # Float buffers saved with the weights (GLM-4-MoE's e_score_correction_bias).
        saved = model.state_dict().keys()
        for name, b in model.named_buffers():
            if name in saved and b.is_floating_point():
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def save_random_checkpoint(config, path: str | Path, seed: int = 0, tokenizer=None):
    """Save a randomly initialized `transformers` model of `config` (float32) to `path`.

    Returns the transformers model (eval mode) for use as the reference. With `tokenizer`, its
    files are saved beside the weights so engines can load the directory as a whole checkpoint.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    path = Path(path)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
        GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
        ).save_pretrained(path)
    return model.eval()


def transformers_gguf_model(path: str | Path):
    """transformers' own float32 load of a GGUF file (eval mode): the reference for GGUF tests."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = Path(path)
    if importlib.util.find_spec("accelerate") is not None:
        return AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
    # from_pretrained(gguf_file=...) refuses to run without `accelerate`, which nothing in ATOM
    # needs; for llama it loads the weights with this same function
    # (GgufHfQuantizer.get_state_dict -> load_gguf_checkpoint).
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(
        str(path), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )
    missing, unexpected = model.load_state_dict(parsed["tensors"], strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.eval()
