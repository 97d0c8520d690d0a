"""What EmbeddingBagCollection's store calls do: pack the features into one batch per table,
call the store once each way, scale mean tables.

The ops (:mod:`embstore.torch._ops`) take no Python objects: they reach the store through a
:class:`Binding`, registered under an int handle that the module passes (a constant in a
compiled graph).

A batch is described by *segments*: ``values`` (ids), ``lens`` (CSR offsets, or lengths)
and optional per-id ``weights``, each holding the bags of one or more consecutive features
(a dict input has one feature per segment; a KeyedJaggedTensor is one segment of all its
keys). Inside the op the features of each table are concatenated into one batch for that
table, its ``padding_id`` is masked out (offsets fixed), and the table's pooled output is
returned whole; the module splits it per feature.

Pooling: the store takes one mode per call. When every table of a call pools by mean the
call uses ``mode="mean"``; otherwise it uses ``"sum"`` and the mean tables are scaled here:
the output divided by each bag's count, and in the backward each id weighted by
``w / count``. These are the very float32 operations the core does for ``"mean"``
(``docs/semantics.md``), so the results are bitwise the same either way.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
import torch

from embstore import _arrays
from embstore.torch._config import EmbeddingBagConfig

__all__ = [
    "Binding",
    "Packed",
    "apply_packed",
    "check_once",
    "feature_bags",
    "grad_array",
    "lookup_packed",
    "pack",
]

Tensor = torch.Tensor
_Bag = tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64], npt.NDArray[np.float32] | None]


@dataclass(frozen=True)
class _TableSpec:
    name: str
    dim: int
    mean: bool
    padding: int | None  # the padding id as uint64, or None


class Binding:
    """What the ops need to reach the store: the backend and the tables' specs, by handle."""

    _handles: ClassVar[itertools.count[int]] = itertools.count(1)
    _live: ClassVar[weakref.WeakValueDictionary[int, Binding]] = weakref.WeakValueDictionary()

    def __init__(self, backend: Any, configs: Sequence[EmbeddingBagConfig]) -> None:
        self.backend = backend
        self.configs = list(configs)
        self.tables = [
            _TableSpec(c.name, c.embedding_dim, c.pooling == "mean", c.padding_key)
            for c in self.configs
        ]
        self.features = [f for c in self.configs for f in c.feature_names]
        self.feature_index = {f: k for k, f in enumerate(self.features)}
        self.feature_table = [t for t, c in enumerate(self.configs) for _ in c.feature_names]
        self.handle = next(Binding._handles)
        Binding._live[self.handle] = self

    def __reduce__(self) -> tuple[Any, ...]:
        return (Binding, (self.backend, self.configs))  # a copy registers a new handle

    @staticmethod
    def of(handle: int) -> Binding:
        binding = Binding._live.get(handle)
        if binding is None:
            msg = f"embstore: no EmbeddingBagCollection with handle {handle} (it was freed)"
            raise RuntimeError(msg)
        return binding

    def tables_of(self, features: Sequence[int]) -> list[int]:
        """The tables read by ``features``, in order of first appearance."""
        return list(dict.fromkeys(self.feature_table[f] for f in features))


def feature_bags(
    counts: Sequence[int], lens: Sequence[Tensor], is_lengths: Sequence[int], bags: Sequence[int]
) -> list[Any]:
    """Bags per feature (ints, or symbolic sizes while tracing), from the segments' shapes:
    ``bags[f] >= 0`` is given; ``-1`` splits the segment's bags evenly over its features."""
    out: list[Any] = []
    f = 0
    for count, length, flag in zip(counts, lens, is_lengths, strict=True):
        total = length.shape[0] - (0 if flag else 1)
        for _ in range(count):
            out.append(bags[f] if bags[f] >= 0 else total // count)
            f += 1
    return out


def _segment_bags(
    binding: Binding,
    features: Sequence[int],
    counts: Sequence[int],
    values: Sequence[Tensor],
    lens: Sequence[Tensor],
    is_lengths: Sequence[int],
    weights: Sequence[Tensor | None],
    bags: Sequence[int],
) -> list[_Bag]:
    """Each feature's (keys, offsets, weights) as numpy, checked, split out of its segment.
    An error names the feature(s) of its segment."""
    out: list[_Bag] = []
    f = 0
    for count, v, length, flag, w in zip(counts, values, lens, is_lengths, weights, strict=True):
        mine = features[f : f + count]
        # a lone CSR feature of a table without padding goes as given: the store checks it
        as_given = count == 1 and bags[f] < 0 and not flag
        as_given = as_given and binding.tables[binding.feature_table[mine[0]]].padding is None
        try:
            out.extend(_split(v, length, bool(flag), w, bags[f : f + count], as_given))
        except (TypeError, ValueError) as exc:
            names = [binding.features[k] for k in mine]
            what = f"features[{names[0]!r}]" if count == 1 else f"features {names}"
            raise type(exc)(f"{what}: {exc}") from None
        f += count
    return out


def _split(
    v: Tensor,
    length: Tensor,
    is_lengths: bool,
    w: Tensor | None,
    bags: Sequence[int],
    as_given: bool,
) -> list[_Bag]:
    """One segment's features: ``bags[j]`` bags each (``-1``: an even share)."""
    keys = _arrays.as_keys(v.numpy(), "values")
    wa = None if w is None else _arrays.as_weights(w.numpy(), keys.shape[0])
    if as_given:
        return [(keys, _arrays.as_offsets(length.numpy()), wa)]
    if is_lengths:
        lengths = _arrays.as_offsets(length.numpy())
        if lengths.size and int(lengths.min()) < 0:
            msg = "lengths must be >= 0"
            raise ValueError(msg)
        offsets = np.zeros(lengths.shape[0] + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
    else:
        offsets = _arrays.as_offsets(length.numpy())
    if offsets[0] != 0 or offsets[-1] != keys.shape[0] or np.any(np.diff(offsets) < 0):
        msg = (
            "offsets must start at 0, never decrease and end at len(values) "
            f"= {keys.shape[0]} (lengths must sum to it)"
        )
        raise ValueError(msg)
    total, count = offsets.shape[0] - 1, len(bags)
    split = [n if n >= 0 else total // count for n in bags]
    if sum(split) != total:
        msg = f"{total} bags do not split into {split} bags per feature"
        raise ValueError(msg)
    out: list[_Bag] = []
    start = 0
    for n in split:
        lo, hi = int(offsets[start]), int(offsets[start + n])
        off = offsets[start : start + n + 1]
        out.append((keys[lo:hi], off - lo if lo else off, None if wa is None else wa[lo:hi]))
        start += n
    return out


def _pack(spec: _TableSpec, pieces: list[_Bag]) -> _Bag:
    """One table's batch: its features' bags back to back, the padding id taken out."""
    if len(pieces) == 1:
        keys, offsets, weights = pieces[0]
    else:
        keys = np.concatenate([p[0] for p in pieces])
        parts, base = [np.zeros(1, np.int64)], 0
        for _, off, _ in pieces:
            parts.append(off[1:] + base)
            base += int(off[-1])
        offsets = np.concatenate(parts)
        weights = None
        if any(p[2] is not None for p in pieces):
            ones = [np.ones(p[0].shape[0], np.float32) for p in pieces]
            weights = np.concatenate(
                [p[2] if p[2] is not None else o for p, o in zip(pieces, ones, strict=True)]
            )
    if spec.padding is not None:
        keep = keys != np.uint64(spec.padding)
        if not keep.all():
            kept = np.zeros(keep.shape[0] + 1, dtype=np.int64)
            np.cumsum(keep, out=kept[1:])
            keys, offsets = keys[keep], kept[offsets]
            weights = None if weights is None else weights[keep]
    return keys, offsets, weights


def _packed(
    binding: Binding, features: Sequence[int], per_feature: list[_Bag]
) -> list[tuple[_TableSpec, _Bag]]:
    """Per table read by ``features`` (first-appearance order): its packed batch."""
    pieces: dict[int, list[_Bag]] = {}
    for f, bag in zip(features, per_feature, strict=True):
        pieces.setdefault(binding.feature_table[f], []).append(bag)
    return [(binding.tables[t], _pack(binding.tables[t], p)) for t, p in pieces.items()]


def _bag_counts(offsets: npt.NDArray[np.int64]) -> npt.NDArray[np.float32]:
    counts: npt.NDArray[np.float32] = np.diff(offsets).astype(np.float32)
    return counts


def _request(spec: _TableSpec, bag: _Bag) -> tuple[Any, ...]:
    keys, offsets, weights = bag
    return (keys, offsets) if weights is None else (keys, offsets, weights)


def grad_array(grad: Tensor) -> npt.NDArray[np.float32]:
    """A pooled gradient as C-contiguous float32 on the CPU, with at most one copy."""
    grad = grad.detach()
    if not (grad.dtype == torch.float32 and grad.device.type == "cpu" and grad.is_contiguous()):
        dense = torch.empty(tuple(grad.shape), dtype=torch.float32)
        dense.copy_(grad)  # one pass: device, dtype and layout together
        grad = dense
    array: npt.NDArray[np.float32] = grad.numpy()
    return array


class Packed:
    """A batch packed for the store: per table read (first-appearance order), its spec and
    ``(keys, offsets, weights)``; and the mode of the store calls."""

    __slots__ = ("binding", "mode", "tables")

    def __init__(self, binding: Binding, tables: list[tuple[_TableSpec, _Bag]]) -> None:
        self.binding = binding
        self.tables = tables
        self.mode = "mean" if all(spec.mean for spec, _ in tables) else "sum"


def pack(
    handle: int,
    features: list[int],
    counts: list[int],
    values: list[Tensor],
    lens: list[Tensor],
    is_lengths: list[int],
    weights: list[Tensor | None],
    bags: list[int],
) -> Packed:
    """The ops' arguments as one batch per table (checked; errors name the feature)."""
    binding = Binding.of(handle)
    per_feature = _segment_bags(binding, features, counts, values, lens, is_lengths, weights, bags)
    return Packed(binding, _packed(binding, features, per_feature))


def lookup_packed(batch: Packed, insert: bool) -> list[Tensor]:
    """Pooled outputs of every table of ``batch``, in one store call."""
    request = {spec.name: _request(spec, bag) for spec, bag in batch.tables}
    pooled = batch.binding.backend.lookup_sum(request, mode=batch.mode, insert=insert)
    outs = []
    for spec, bag in batch.tables:
        out = np.asarray(pooled[spec.name], dtype=np.float32)
        if not out.flags.writeable or not out.flags.c_contiguous:
            out = np.array(out, dtype=np.float32)
        if spec.mean and batch.mode == "sum":
            counts_f = _bag_counts(bag[1])[:, None]
            np.divide(out, counts_f, out=out, where=counts_f > 0)
        outs.append(torch.from_numpy(out))  # shares memory with the store's output
    return outs


def apply_packed(batch: Packed, grads: Sequence[Tensor | None]) -> None:
    """The backward of :func:`lookup_packed`: every table's gradient in one store call."""
    entries: dict[str, tuple[Any, ...]] = {}
    for (spec, (keys, offsets, w)), grad in zip(batch.tables, grads, strict=True):
        if grad is None:  # no loss depends on this output: no update at all
            continue
        g = grad_array(grad)
        if spec.mean and batch.mode == "sum":  # c_i = w_i / count_b, as the core's mean does
            counts_f = _bag_counts(offsets)
            per_id = np.repeat(counts_f, counts_f.astype(np.int64))
            w = (np.float32(1.0) if w is None else w) / per_id
        entries[spec.name] = (keys, offsets, g) if w is None else (keys, offsets, g, w)
    if entries:
        batch.binding.backend.apply_gradients(entries, mode=batch.mode)


def check_once(applied: bool) -> None:
    """Raise if this forward's gradients were already applied."""
    if applied:
        msg = (
            "embstore: a second backward through the same EmbeddingBagCollection forward; "
            "its gradients were already applied to the store. Each forward applies its "
            "gradients once: backpropagate the sum of the losses in one backward call."
        )
        raise RuntimeError(msg)
