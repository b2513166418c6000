"""What every layer kind of the native host that owns a paged cache shares: `NativeCacheLayer`
(it says how many bytes a token costs it and binds its own cache, so the runner sizes blocks
without knowing the layer kinds), the fp8 cache dtypes, and the engine's `intercept_attention`
seam (the piecewise CUDA graphs end a captured piece at each cache layer)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # annotations only: atom_models.layers picks this host lazily
    from atom_models.layers.attention import AttentionSpec
    from atom_models.layers.mla import MLAAttentionSpec


KV_CACHE_FP8_DTYPES = (torch.float8_e4m3fn,)


# fn(layer, args) -> the layer's output, called instead of every native cache layer while set
AttentionInterceptor = Callable[["NativeCacheLayer", tuple], torch.Tensor]
_interceptor: AttentionInterceptor | None = None


@contextlib.contextmanager
def intercept_attention(fn: AttentionInterceptor) -> Iterator[None]:
    """Inside this block a call of any native cache layer goes to `fn(layer, args)` instead of
    the layer's forward (which `fn` may run: `layer.attend(*args)`). The engine's piecewise CUDA
    graphs end a captured piece there: the layer's inputs are per-token tensors (dim 0: the
    step's tokens) and its output is one too."""
    global _interceptor
    previous, _interceptor = _interceptor, fn
    try:
        yield
    finally:
        _interceptor = previous


def attention_intercepted() -> bool:
    """Whether calls of native cache layers go to an interceptor now (a piecewise capture)."""
    return _interceptor is not None


class NativeCacheLayer(nn.Module):
    """A native attention layer that owns a paged cache (`spec.layer_idx` orders them)."""

    spec: AttentionSpec | MLAAttentionSpec
    kv_scales: dict[str, float]  # "k" / "v" -> per-tensor fp8 cache scale

    def __call__(self, *args: torch.Tensor | None) -> torch.Tensor:
        if _interceptor is not None:
            return _interceptor(self, args)
        return super().__call__(*args)

    def attend(self, *args: torch.Tensor | None, **kwargs: torch.Tensor) -> torch.Tensor:
        """The layer's own forward, also inside `intercept_attention` (for the interceptor)."""
        return super().__call__(*args, **kwargs)

    def set_kv_scale(self, which: str, value: float) -> None:
        """The checkpoint's per-tensor scale of the K ("k") or V ("v") cache."""
        self.kv_scales[which] = value

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def bind_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> tuple[torch.Tensor, ...]:
        """Allocate (zeroed) and keep this layer's cache; returns its tensors."""
        raise NotImplementedError

    def release_cache(self) -> None:
        raise NotImplementedError
