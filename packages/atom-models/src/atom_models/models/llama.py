"""Llama (2, 3, 3.1, 3.2; also SmolLM2, Mistral-style dense models)."""

from __future__ import annotations

from itertools import islice

import torch
from torch import nn

import atom_kernels
from atom_models.distributed import get_tp_group
from atom_models.layers import prefetch
from atom_models.layers.activation import SiluAndMul
from atom_models.layers.attention import Attention
from atom_models.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atom_models.layers.linear import (
    UNQUANTIZED,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from atom_models.layers.norm import RMSNorm
from atom_models.layers.prefetch import WeightPrefetch
from atom_models.layers.rotary import get_rope, partial_rotary_factor, rope_parameters
from atom_models.models.base import CausalLMBase


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The layer's sliding window from `layer_types` (transformers 5) or legacy fields."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None and not hasattr(config, "use_sliding_window"):
        return getattr(config, "sliding_window", None)  # Mistral, Mixtral: every layer
    if layer_types is not None:
        is_sliding = layer_types[layer_idx] == "sliding_attention"
    else:
        is_sliding = getattr(config, "use_sliding_window", False) and layer_idx >= getattr(
            config, "max_window_layers", 0
        )
    return getattr(config, "sliding_window", None) if is_sliding else None


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()
        # Asked of L2 as gate_up starts: down's weights; as down starts: the next layer's QKV
        # projection's (LlamaModel fills it in; layers/prefetch.py, ATOM_L2_PREFETCH).
        self.prefetch_down = WeightPrefetch("mlp", [self.down_proj])
        self.prefetch_next = WeightPrefetch("next", [])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        self.prefetch_down.start(x)
        if gate_up.quant_method is UNQUANTIZED:
            # One op (one launch at batch-1 decode on the Triton backend): the GEMM, then SiLU.
            h = atom_kernels.linear_silu_and_mul(x, gate_up.weight, gate_up.bias)
        else:  # a quantized (or host-supplied) GEMM
            h = self.act_fn(gate_up(x))
        self.prefetch_next.start(h)
        return self.down_proj(h)

    def forward_after_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(norm(x, residual))`` -> (out, new residual); unquantized, the residual add and
        norm go into the gate/up op (the same kernel at batch-1 decode on the Triton backend)."""
        gate_up = self.gate_up_proj
        if gate_up.quant_method is not UNQUANTIZED:
            x, residual = norm(x, residual)
            return self(x), residual
        self.prefetch_down.start(x)
        h, residual = atom_kernels.fused_add_rms_norm_linear_silu_and_mul(
            x, residual, norm.weight, norm.eps, gate_up.weight, gate_up.bias
        )
        self.prefetch_next.start(h)
        return self.down_proj(h), residual


def first_mlp_gemm(mlp: nn.Module) -> nn.Module | None:
    """The first GEMM a layer's MLP runs whose weights are known before it runs: a dense MLP's
    gate_up, an MoE block's shared experts' (its routed experts wait on the router)."""
    if isinstance(mlp, LlamaMLP):
        return mlp.gate_up_proj
    shared = getattr(mlp, "shared_experts", None)
    return shared.gate_up_proj if isinstance(shared, LlamaMLP) else None


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, prefix: str) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        bias = getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
        )
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bias=bias,
            input_padding=self.qkv_proj.num_dummy_heads * head_dim,
        )
        base, scaling = rope_parameters(config)
        self.rotary_emb = get_rope(
            head_dim,
            config.max_position_embeddings,
            base,
            scaling,
            partial_rotary_factor=partial_rotary_factor(config),
        )
        self.attn = Attention(
            self.qkv_proj.num_heads,
            head_dim,
            head_dim**-0.5,
            self.qkv_proj.num_kv_heads,
            prefix=f"{prefix}.attn",
            sliding_window=sliding_window_of(config, layer_idx),
        )
        # While the attention runs: the output projection's weights (and the MLP's, added by
        # the decoder layer) asked of L2 (layers/prefetch.py, ATOM_L2_PREFETCH).
        self.prefetch = WeightPrefetch("attn", [self.o_proj])
        self.prefetch_early = WeightPrefetch("qkv", self.prefetch.modules)  # the same list

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        self.prefetch_early.start(hidden_states)
        return self.attend(positions, self.qkv_proj(hidden_states))

    def forward_after_norm(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``self(positions, norm(x, residual))`` -> (out, new residual: x without one);
        unquantized, the norm goes into the QKV projection's op (one kernel at batch-1 decode
        on the Triton backend)."""
        qkv = self.qkv_proj
        if qkv.quant_method is not UNQUANTIZED:
            x, residual = (norm(x), x) if residual is None else norm(x, residual)
            return self(positions, x), residual
        self.prefetch_early.start(x)
        h, residual = atom_kernels.rms_norm_linear(
            x, residual, norm.weight, norm.eps, qkv.weight, qkv.bias
        )
        return self.attend(positions, h), residual

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
        """Everything after the QKV projection (subclasses change this, not forward)."""
        q, k, v = self.qkv_proj.split(qkv)
        self.prefetch.start(qkv)
        # The rotary and the K/V cache write: one kernel on ATOM's engine (Attention.forward_rope).
        return self.o_proj(self.attn.forward_rope(positions, q, k, v, self.rotary_emb))


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = LlamaAttention

    def __init__(self, config, layer_idx: int, prefix: str) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_idx, prefix=f"{prefix}.self_attn")
        self.mlp = self.build_mlp(config, layer_idx, prefix=f"{prefix}.mlp")
        attn_prefetch = getattr(self.self_attn, "prefetch", None)
        first = first_mlp_gemm(self.mlp)
        if attn_prefetch is not None and first is not None:
            attn_prefetch.modules.append(first)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # On a group that fuses them (the engine's peer all-reduce on GPUs), o_proj's all-reduce
        # moves into the post-attention residual add + norm: one kernel for the three.
        tp, o_proj = get_tp_group(), getattr(self.self_attn, "o_proj", None)
        self.reduce_group = tp if getattr(tp, "fuses_all_reduce_norm", False) else None
        if (
            self.reduce_group is not None
            and isinstance(o_proj, RowParallelLinear)
            and o_proj.reduce_results
        ):
            o_proj.reduce_results = False
        else:
            self.reduce_group = None

    def build_mlp(self, config, layer_idx: int, prefix: str) -> nn.Module:
        """The layer's feed-forward block (MoE models choose dense or sparse per layer)."""
        return LlamaMLP(
            config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False)
        )

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Each norm goes into the op after it (one launch for both at batch-1 decode on the
        # Triton backend), unless the attention customizes its forward.
        attn = self.self_attn
        if isinstance(attn, LlamaAttention) and type(attn).forward is LlamaAttention.forward:
            hidden_states, residual = attn.forward_after_norm(
                positions, hidden_states, residual, self.input_layernorm
            )
        else:
            if residual is None:
                hidden_states, residual = self.input_layernorm(hidden_states), hidden_states
            else:
                hidden_states, residual = self.input_layernorm(hidden_states, residual)
            hidden_states = attn(positions, hidden_states)
        if self.reduce_group is not None:  # hidden_states: this rank's part of o_proj's sum
            norm = self.post_attention_layernorm
            hidden_states, residual = self.reduce_group.all_reduce_add_rms_norm(
                hidden_states, residual, norm.weight, norm.eps
            )
            return self.mlp(hidden_states), residual
        if isinstance(self.mlp, LlamaMLP):
            return self.mlp.forward_after_norm(
                hidden_states, residual, self.post_attention_layernorm
            )
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    decoder_layer_cls: type[nn.Module] = LlamaDecoderLayer

    def __init__(self, config, prefix: str = "model") -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(config, i, prefix=f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # The decoder stack; multi-token-prediction layers may follow it in `layers`.
        self.num_hidden_layers = config.num_hidden_layers
        stack = list(islice(self.layers, self.num_hidden_layers))
        for layer, after in zip(stack, stack[1:], strict=False):
            mlp, qkv = getattr(layer, "mlp", None), getattr(after.self_attn, "qkv_proj", None)
            if isinstance(mlp, LlamaMLP) and qkv is not None:
                mlp.prefetch_next.modules = [qkv]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        for layer in islice(self.layers, self.num_hidden_layers):
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        prefetch.join(hidden_states)  # the side stream's prefetch launches (layers/prefetch.py)
        return hidden_states


class LlamaForCausalLM(CausalLMBase):
    model_cls: type[nn.Module] = LlamaModel
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] (all sequences of the step, flattened) -> [T, hidden]."""
        return self.model(input_ids, positions)
