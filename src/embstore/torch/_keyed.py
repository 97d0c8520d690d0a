"""KeyedTensor: pooled outputs by feature, shaped like TorchRec's KeyedTensor."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["KeyedTensor"]


class KeyedTensor:
    """Per-feature pooled tensors ``[batch, dim_k]``, what a KeyedJaggedTensor input gives.

    The interface TorchRec's ``KeyedTensor`` offers a model: :meth:`keys`, :meth:`values`
    (``[batch, sum(dims)]``, the features side by side in key order), :meth:`length_per_key`
    (the dims), :meth:`offset_per_key`, :meth:`to_dict` and ``kt[key]``. The per-feature
    tensors are the module's outputs (no copy); :meth:`values` concatenates them once.
    """

    def __init__(self, keys: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(tensors):
            msg = f"keys and tensors must have the same length, got {len(keys)} and {len(tensors)}"
            raise ValueError(msg)
        self._keys = list(keys)
        self._tensors = list(tensors)
        self._values: torch.Tensor | None = None

    def keys(self) -> list[str]:
        """The feature names, in order."""
        return list(self._keys)

    def values(self) -> torch.Tensor:
        """All features side by side: float32 ``[batch, sum(length_per_key())]``."""
        if self._values is None:
            self._values = torch.cat(self._tensors, dim=1)
        return self._values

    def key_dim(self) -> int:
        """The dimension of :meth:`values` that the keys split (always 1)."""
        return 1

    def length_per_key(self) -> list[int]:
        """Each feature's width in :meth:`values`."""
        return [int(t.shape[1]) for t in self._tensors]

    def offset_per_key(self) -> list[int]:
        """Where each feature starts in :meth:`values`, then the total width."""
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{feature: float32 [batch, dim]}``."""
        return dict(zip(self._keys, self._tensors, strict=True))

    def __getitem__(self, key: str) -> torch.Tensor:
        try:
            return self._tensors[self._keys.index(key)]
        except ValueError:
            msg = f"no feature {key!r}; the keys are {self._keys}"
            raise KeyError(msg) from None

    def __repr__(self) -> str:
        return f"KeyedTensor(keys={self._keys}, length_per_key={self.length_per_key()})"
