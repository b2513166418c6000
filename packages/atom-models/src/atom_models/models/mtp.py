"""Multi-token-prediction (MTP) layers: the drafters DeepSeek-V3-family and GLM-4-MoE
checkpoints carry for speculative decoding.

A checkpoint with `num_nextn_predict_layers = n` appends n layers to its decoder stack, named
`model.layers.{num_hidden_layers + i}`: each is a whole decoder layer (attention, MoE or dense MLP
as its index dictates) plus `enorm`, `hnorm`, `eh_proj` and `shared_head` (`norm`, `head`). ATOM
builds them in `model.layers` after the decoder stack, under their checkpoint names, so they load,
quantize and shard like the decoder layers and ATOM's own host gives their attention a paged
cache of its own (`bind_kv_cache`); the model's forward runs the decoder stack only. A checkpoint
whose config names MTP layers but that holds no MTP tensors (transformers' DeepseekV3Config says
`num_nextn_predict_layers=1` by default; re-exports drop the layers) loads without them.

Draft step k runs MTP layer k % n (T = tokens, H = hidden size):

    x = eh_proj([enorm(embed(ids)) (zero at position 0), hnorm(previous_hidden)])  # [T, H]
    h = decoder_layer(x) + its residual                                            # [T, H]
    logits = shared_head.head(shared_head.norm(h))

`previous_hidden` is, for the first step, the target model's output hidden state (what
`model(ids, positions)` returns: after the final norm, the state vLLM's and SGLang's MTP drafters
are fed) and, for a chained step, the previous step's `h`.

Hosts that run their own drafters (vLLM, SGLang: their MTP draft models are separate modules with
the same layer names) do not get these layers: they are built only where the attention host says
`builds_mtp_layers` (ATOM's engine), and their checkpoint tensors are skipped otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from atom_models.layers import prefetch
from atom_models.layers.attention import get_attention_host
from atom_models.layers.embedding import ParallelLMHead
from atom_models.layers.linear import ReplicatedLinear
from atom_models.layers.norm import RMSNorm
from atom_models.quantization import process_weights_after_loading
from atom_models.weights import CheckpointMismatchError, load_weights

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = ParallelLMHead(vocab_size, hidden_size)
        # A checkpoint without its own MTP head uses the model's LM head (tied after loading).
        self.head.weight.optional = True
        self.head.weight.default = 0.0


class MTPLayerMixin:
    """Mixed in before a decoder-layer class: that layer plus the MTP input projection and head
    (`class DeepseekV3MTPLayer(MTPLayerMixin, DeepseekV3DecoderLayer)`)."""

    def __init__(self, config, layer_idx: int, prefix: str) -> None:
        super().__init__(config, layer_idx, prefix)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        # Stored unquantized in quantized checkpoints (DeepSeek-V3's FP8 release; vLLM and SGLang
        # build it as a plain nn.Linear), whatever the quantization_config covers.
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden, bias=False)
        self.eh_proj.quantizable = False
        self.shared_head = SharedHead(hidden, config.vocab_size, eps)

    def mtp_forward(
        self, embeds: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor
    ) -> torch.Tensor:
        """embeds, previous_hidden [T, H] -> [T, H], the residual stream after the layer."""
        x = torch.cat([self.enorm(embeds), self.hnorm(previous_hidden)], dim=-1)  # [T, 2H]
        hidden_states, residual = self(positions, self.eh_proj(x), None)
        return hidden_states + residual


class MultiTokenPredictionMixin:
    """Mixed in before a `<Arch>ForCausalLM` (a LlamaForCausalLM): its MTP layers, the drafter
    interface and their weight loading. `__init__` calls `add_mtp_layers()` once built."""

    mtp_layer_cls: type[nn.Module]
    num_mtp_layers: int = 0

    def add_mtp_layers(self) -> None:
        config = self.config
        total = getattr(config, "num_nextn_predict_layers", None) or 0
        self.num_mtp_layers = total if _host_builds_mtp_layers() else 0
        first = config.num_hidden_layers
        for idx in range(first, first + self.num_mtp_layers):
            self.model.layers.append(self.mtp_layer_cls(config, idx, prefix=f"model.layers.{idx}"))

    def mtp_layer(self, step: int = 0) -> nn.Module:
        """The MTP layer that draft step `step` runs (step % num_mtp_layers)."""
        if self.num_mtp_layers == 0:
            raise ValueError(
                f"{type(self).__name__} has no multi-token-prediction layers: the checkpoint's "
                "config has no num_nextn_predict_layers (or 0), or the attention host does not "
                "build them (vLLM and SGLang run their own MTP drafters)"
            )
        return self.model.layers[self.config.num_hidden_layers + step % self.num_mtp_layers]

    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        previous_hidden: torch.Tensor,
        step: int = 0,
    ) -> torch.Tensor:
        """Draft step `step`: input_ids, positions [T] long; previous_hidden [T, hidden] (the
        target model's output for step 0, the previous mtp_forward output after) -> [T, hidden]
        in the model dtype, before shared_head.norm. Attention reads the forward context set
        around the call and writes the MTP layer's own paged cache, like `forward`."""
        layer = self.mtp_layer(step)
        embeds = self.model.embed_tokens(input_ids)  # [T, hidden]
        # Position 0 has no previous token for the hidden state to have predicted from (vLLM).
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0.0)
        out = layer.mtp_forward(embeds, positions, previous_hidden)
        prefetch.join(out)  # a prefetch its layer launched (layers/prefetch.py)
        return out

    def compute_mtp_logits(self, hidden_states: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[T, hidden] (an mtp_forward output) -> [T, vocab] draft logits, gathered over the
        tensor-parallel ranks like compute_logits."""
        head = self.mtp_layer(step).shared_head
        return head.head.compute_logits(head.norm(hidden_states))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's MTP tensors go to the MTP layers (skipped where they are not built);
        each layer's copy of the embedding is skipped (it is the model's: DeepSeek-V3 shares it),
        and a layer without its own head gets the model's LM head. Without any MTP tensor the
        MTP layers are dropped (num_mtp_layers becomes 0)."""
        first = self.config.num_hidden_layers
        total = getattr(self.config, "num_nextn_predict_layers", None) or 0
        built = range(first, first + self.num_mtp_layers)
        with_head: set[int] = set()

        def kept():
            for name, tensor in weights:
                match = _LAYER.match(name)
                idx = -1 if match is None else int(match.group(1))
                if first <= idx < first + total:
                    leaf = name[match.end() :]
                    if idx not in built or leaf.startswith("embed_tokens."):
                        continue
                    if leaf == "shared_head.head.weight":
                        with_head.add(idx)
                yield name, tensor

        names = [f"model.layers.{idx}" for idx in built]
        loaded = load_weights(self, kept(), optional_modules=names)
        present = [any(n.startswith(f"{name}.") for n in loaded) for name in names]
        if any(present) and not all(present):
            absent = [name for name, p in zip(names, present, strict=True) if not p]
            raise CheckpointMismatchError(
                f"the checkpoint has some multi-token-prediction layers but not {absent}"
            )
        if not all(present):
            del self.model.layers[first:]
            self.num_mtp_layers = 0
        for idx in built[: self.num_mtp_layers]:
            if idx not in with_head:
                self.model.layers[idx].shared_head.head.weight = self.lm_head.weight
        process_weights_after_loading(self)
        return loaded


def _host_builds_mtp_layers() -> bool:
    return bool(getattr(get_attention_host(), "builds_mtp_layers", False))
