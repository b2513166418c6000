"""A safetensors tensor not read yet, for tensor-parallel ranks: `narrow` (and a slice of the
first dimension) reads only that range from the file (`safe_open(...).get_slice`), so a rank whose
`weight_loader` cuts its part with `narrow` reads its part only; any other use reads the tensor
whole, once, and goes on as that tensor (`__getattr__`, `__torch_function__`)."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

# safetensors' dtype names.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


class CheckpointSlice:
    """Tensor `name` of the open safetensors file `f` (which it keeps open)."""

    def __init__(self, f, name: str) -> None:
        self._file, self._name = f, name
        self._slice = f.get_slice(name)
        self.shape = torch.Size(self._slice.get_shape())
        self._dtype = _DTYPES.get(self._slice.get_dtype())
        self._whole: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype if self._dtype is not None else self.whole().dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def whole(self) -> torch.Tensor:
        if self._whole is None:
            self._whole = self._file.get_tensor(self._name)
        return self._whole

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim = dim % len(self.shape)
        if self._whole is not None or length <= 0 or not 0 <= start <= self.shape[dim] - length:
            return self.whole().narrow(dim, start, length)  # torch's result, or its error
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._slice[index]

    def __getitem__(self, index):
        if isinstance(index, slice) and index.step in (None, 1) and self._whole is None:
            start, stop, _ = index.indices(self.shape[0])
            if stop > start:
                return self.narrow(0, start, stop - start)
        return self.whole()[index]

    def __len__(self) -> int:
        return self.shape[0]

    def __getattr__(self, name: str):
        return getattr(self.whole(), name)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def unwrap(x):
            return x.whole() if isinstance(x, CheckpointSlice) else x

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
