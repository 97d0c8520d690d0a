"""The input forms of EmbeddingBagCollection.forward, as segments for the custom ops.

- ``{feature: (keys, offsets)}`` or ``(keys, offsets, weights)``: CSR bags with the final
  end offset, as :meth:`Table.lookup_sum` takes them;
- ``{feature: {"values": keys, "lengths": lengths}}`` (or ``"offsets"``; optional
  ``"weights"``), or ``{feature: jagged}`` with a TorchRec ``JaggedTensor``-like value;
- a ``KeyedJaggedTensor``: TorchRec's, or any object with ``keys()``, ``values()``,
  ``lengths()`` or ``offsets()`` and ``weights_or_none()`` (``stride_per_key()`` is used
  when ``variable_stride_per_key()`` says the keys have different batch sizes).

Tensors stay tensors (CPU); numpy arrays and lists become tensors without a copy when they
can. Nothing here reads the data, so a traced forward has no data-dependent shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["Batch", "batch_of"]

Tensor = torch.Tensor


class Batch:
    """Segments in the ops' layout, and the feature names in input order."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.features: list[int] = []
        self.counts: list[int] = []
        self.values: list[Tensor] = []
        self.lens: list[Tensor] = []
        self.is_lengths: list[int] = []
        self.weights: list[Tensor | None] = []
        self.bags: list[int] = []
        self.keyed = False  # a KeyedJaggedTensor came in: a KeyedTensor goes out

    def add(
        self,
        names: list[str],
        values: Tensor,
        lens: Tensor,
        is_lengths: bool,
        weights: Tensor | None,
        bags: list[int],
    ) -> None:
        self.names.extend(names)
        self.counts.append(len(names))
        self.values.append(values)
        self.lens.append(lens)
        self.is_lengths.append(1 if is_lengths else 0)
        self.weights.append(weights)
        self.bags.extend(bags)


def _tensor(value: Any, what: str) -> Tensor:
    """``value`` as a CPU tensor that requires no grad (numpy arrays shared, not copied)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            msg = (
                f"{what} requires grad, but embstore treats it as a constant (no gradient "
                "flows to it); pass it detached"
            )
            raise ValueError(msg)
        if value.device.type != "cpu":
            msg = f"{what} must be a CPU tensor, got device {value.device}"
            raise ValueError(msg)
        return value
    array = np.asarray(value)
    if array.dtype.kind not in "iuf" and not (array.size == 0 and array.ndim == 1):
        msg = f"{what} must be an array of numbers, got dtype {array.dtype}"
        raise TypeError(msg)
    if array.size == 0 and array.dtype.kind == "f" and not isinstance(value, np.ndarray):
        array = array.astype(np.int64)  # [] parses as float64
    if not array.flags.writeable:
        array = array.copy()  # torch.from_numpy warns on read-only arrays
    return torch.from_numpy(array)


def _is_jagged(value: Any) -> bool:
    return callable(getattr(value, "values", None)) and (
        callable(getattr(value, "lengths", None)) or callable(getattr(value, "offsets", None))
    )


def _jagged_parts(value: Any, what: str) -> tuple[Tensor, Tensor, bool, Tensor | None]:
    """values, lengths-or-offsets, which, weights of a JaggedTensor-like object."""
    values = _tensor(value.values(), f"{what} values()")
    if callable(getattr(value, "lengths", None)):
        lens, is_lengths = _tensor(value.lengths(), f"{what} lengths()"), True
    else:
        lens, is_lengths = _tensor(value.offsets(), f"{what} offsets()"), False
    getter = getattr(value, "weights_or_none", None)
    raw = getter() if callable(getter) else None
    weights = None if raw is None else _tensor(raw, f"{what} weights_or_none()")
    return values, lens, is_lengths, weights


def _add_feature(batch: Batch, name: str, feature: Any) -> None:
    what = f"features[{name!r}]"
    if isinstance(feature, tuple):
        if len(feature) not in (2, 3):
            msg = f"{what} must be (keys, offsets) or (keys, offsets, weights)"
            raise ValueError(msg)
        keys = _tensor(feature[0], f"{what} keys")
        offsets = _tensor(feature[1], f"{what} offsets")
        weights = _tensor(feature[2], f"{what} weights") if len(feature) == 3 else None
        batch.add([name], keys, offsets, False, weights, [-1])
    elif isinstance(feature, Mapping):
        given = set(feature)
        known = {"values", "lengths", "offsets", "weights"}
        if "values" not in given or len(given & {"lengths", "offsets"}) != 1 or given - known:
            msg = (
                f"{what} as a mapping needs 'values' and one of 'lengths' or 'offsets' "
                f"(and optionally 'weights'), got keys {sorted(map(str, given))}"
            )
            raise ValueError(msg)
        is_lengths = "lengths" in given
        lens = feature["lengths"] if is_lengths else feature["offsets"]
        weights = feature.get("weights")
        batch.add(
            [name],
            _tensor(feature["values"], f"{what} values"),
            _tensor(lens, f"{what} {'lengths' if is_lengths else 'offsets'}"),
            is_lengths,
            None if weights is None else _tensor(weights, f"{what} weights"),
            [-1],
        )
    elif _is_jagged(feature):
        values, lens_t, is_len, w = _jagged_parts(feature, what)
        batch.add([name], values, lens_t, is_len, w, [-1])
    else:
        msg = (
            f"{what} must be (keys, offsets[, weights]), a mapping with 'values' and "
            f"'lengths' or 'offsets', or a JaggedTensor; got {type(feature).__name__}"
        )
        raise ValueError(msg)


def batch_of(features: Any, feature_index: Mapping[str, int]) -> Batch:
    """The :class:`Batch` of a forward's input (see the module docstring for the forms)."""
    batch = Batch()
    if isinstance(features, Mapping):
        for name, feature in features.items():
            _add_feature(batch, name, feature)
    elif callable(getattr(features, "keys", None)) and _is_jagged(features):
        names = list(features.keys())
        values, lens, is_lengths, weights = _jagged_parts(features, "KeyedJaggedTensor")
        bags = [-1] * len(names)
        variable = getattr(features, "variable_stride_per_key", None)
        if callable(variable) and variable():
            bags = [int(n) for n in features.stride_per_key()]
        if names:
            batch.add(names, values, lens, is_lengths, weights, bags)
        batch.keyed = True
    else:
        msg = (
            "features must be a mapping of name -> (keys, offsets[, weights]) (or of "
            "jagged features), or a KeyedJaggedTensor; got " + type(features).__name__
        )
        raise TypeError(msg)
    for name in batch.names:
        index = feature_index.get(name)
        if index is None:
            msg = f"unknown feature {name!r}: no table reads it; the features are {list(feature_index)}"
            raise KeyError(msg)
        batch.features.append(index)
    if len(set(batch.features)) != len(batch.features):
        msg = f"features: a feature is given twice in {batch.names}"
        raise ValueError(msg)
    return batch
