"""PyTorch front end: :class:`EmbeddingBagCollection`, a ``torch.nn.Module`` over a TableGroup.

Needs the optional extra ``embstore[torch]``; ``import embstore`` never imports torch.

The forward pools every table's bags in ONE call into the store
(:meth:`TableGroup.lookup_sum`) and returns tensors that share memory with the store's
output buffers (``torch.from_numpy``, no copy). The backward gathers the pooled gradients of
every table and applies them in ONE call (:meth:`TableGroup.apply_gradients`) with each
table's fused optimizer. The store's rows are not torch Parameters: ``module.parameters()``
is empty, and the dense part of a model trains with any torch optimizer as usual.

Rules (what the tests check):

- **Training forward** (``module.training`` and grad mode on): missing ids are inserted
  with their initial rows, as :meth:`Table.lookup_sum` does with ``insert=True``. The
  gradients are applied when ``backward`` reaches the outputs, once.
- **Eval forward** (``module.eval()``, ``torch.no_grad()`` or ``torch.inference_mode()``):
  read-only. Nothing is inserted (a missing id pools as zeros), nothing is ever written,
  and the outputs have no ``grad_fn``.
- **A forward that is never backpropagated applies nothing.** A forward's outputs can be
  backpropagated once: a second ``backward`` that reaches them (``retain_graph=True``, or
  one backward per output) raises ``RuntimeError`` instead of updating the rows twice.
  Backpropagate the sum of the losses once.
- An output that no loss depends on gets no update (no zero-gradient step either).
- Keys, offsets and weights may be tensors (CPU) or numpy arrays. They are kept by
  reference until the backward: do not modify them in place in between (a tensor that was
  modified raises ``RuntimeError`` in the backward, as torch itself does; a numpy array
  cannot be checked). Per-id weights are constants: weights that require grad raise.
- Gradients may be non-contiguous, expanded, on another device or of another float dtype:
  each is converted to C-contiguous float32 on the CPU with at most one copy.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from embstore import _arrays
from embstore.group import TableGroup

__all__ = ["EmbeddingBagCollection"]

_Feature = tuple[Any, ...]


def _as_numpy(value: Any, what: str) -> tuple[Any, torch.Tensor | None]:
    """``value`` as something numpy reads without a copy; the tensor it came from, if any."""
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
        return value.numpy(), value
    return value, None


class _Pending:
    """One training-mode forward: what its backward needs, and whether it has run."""

    __slots__ = ("applied", "group", "inputs", "mode", "names", "outs", "tensors", "versions")

    def __init__(
        self,
        group: TableGroup,
        mode: str,
        inputs: dict[str, _Feature],
        outs: list[npt.NDArray[np.float32]],
        tensors: list[torch.Tensor],
    ) -> None:
        self.group = group
        self.mode = mode
        self.names = list(inputs)
        self.inputs = inputs
        self.outs = outs
        self.tensors = tensors
        self.versions = [_version(t) for t in tensors]
        self.applied = False

    def apply(self, grads: tuple[torch.Tensor | None, ...]) -> None:
        if self.applied:
            msg = (
                "embstore: a second backward through the same EmbeddingBagCollection forward; "
                "its gradients were already applied to the store. Each forward applies its "
                "gradients once: backpropagate the sum of the losses in one backward call."
            )
            raise RuntimeError(msg)
        self.applied = True  # before applying: never twice, even after a failed apply
        inputs, tensors = self.inputs, self.tensors
        self.inputs, self.tensors = {}, []  # release the batch (a retained graph keeps us)
        for tensor, version in zip(tensors, self.versions):
            if _version(tensor) != version:
                msg = (
                    "embstore: a keys/offsets/weights tensor of this forward was modified in "
                    "place before the backward; its gradients would go to the wrong rows"
                )
                raise RuntimeError(msg)
        entries: dict[str, _Feature] = {}
        for name, grad in zip(self.names, grads):
            if grad is None:  # no loss depends on this output: no update at all
                continue
            feature = inputs[name]
            entries[name] = (feature[0], feature[1], _grad_array(grad), *feature[2:])
        if entries:
            self.group.apply_gradients(entries, mode=self.mode)


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place modification counter (what autograd checks)."""
    return int(tensor._version)


def _grad_array(grad: torch.Tensor) -> npt.NDArray[np.float32]:
    """A pooled gradient as C-contiguous float32 on the CPU, with at most one copy."""
    grad = grad.detach()
    if not (grad.dtype == torch.float32 and grad.device.type == "cpu" and grad.is_contiguous()):
        dense = torch.empty(tuple(grad.shape), dtype=torch.float32)
        dense.copy_(grad)  # one pass: device, dtype and layout together
        grad = dense
    array: npt.NDArray[np.float32] = grad.numpy()
    return array


class _LookupApply(torch.autograd.Function):
    """Outputs: the pooled tensors (already computed); backward: one fused group apply.

    ``anchor`` is an empty tensor that requires grad: it makes autograd record this node,
    since the store's rows are not tensors. Its gradient is always None.
    """

    @staticmethod
    def forward(ctx: Any, pending: _Pending, anchor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        del anchor
        ctx.set_materialize_grads(False)
        ctx.pending = pending
        outs, pending.outs = pending.outs, []
        return tuple(torch.from_numpy(out) for out in outs)  # shares memory

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, None]:
        pending: _Pending = ctx.pending
        pending.apply(grads)
        return None, None


class EmbeddingBagCollection(torch.nn.Module):
    """Pooled embeddings of every table of a :class:`~embstore.TableGroup`, with a fused
    backward.

    Parameters
    ----------
    group : TableGroup
        The tables; each table's optimizer is applied in the backward.
    mode : {"sum", "mean"}
        Pooling of every bag, as in :meth:`TableGroup.lookup_sum`.

    ``forward(features)`` takes ``{name: (keys, offsets)}`` or ``{name: (keys, offsets,
    weights)}`` (tensors or numpy arrays, CSR bags as in :meth:`Table.lookup_sum`) and
    returns ``{name: float32 tensor [bags, dim]}``. See the module docstring for the
    training / eval rules.
    """

    def __init__(self, group: TableGroup, *, mode: str = "sum") -> None:
        super().__init__()
        if not isinstance(group, TableGroup):
            msg = f"group must be an embstore.TableGroup, got {type(group).__name__}"
            raise TypeError(msg)
        _arrays.mode_code(mode)  # ValueError for an unknown mode
        self.group = group
        self.mode = mode

    def extra_repr(self) -> str:
        dims = ", ".join(f"{name}: {table.dim}" for name, table in self.group.items())
        return f"tables={{{dims}}}, mode={self.mode!r}"

    def forward(self, features: Mapping[str, _Feature]) -> dict[str, torch.Tensor]:
        if not isinstance(features, Mapping):
            msg = (
                "features must be a mapping of name -> (keys, offsets[, weights]), "
                f"got {type(features).__name__}"
            )
            raise TypeError(msg)
        inputs: dict[str, _Feature] = {}
        tensors: list[torch.Tensor] = []
        for name, feature in features.items():
            if not isinstance(feature, tuple) or len(feature) not in (2, 3):
                msg = f"features[{name!r}] must be (keys, offsets) or (keys, offsets, weights)"
                raise ValueError(msg)
            parts = []
            for part, what in zip(feature, ("keys", "offsets", "weights")):
                array, tensor = _as_numpy(part, f"features[{name!r}] {what}")
                parts.append(array)
                if tensor is not None:
                    tensors.append(tensor)
            inputs[name] = tuple(parts)
        training = self.training and torch.is_grad_enabled()
        pooled = self.group.lookup_sum(inputs, mode=self.mode, insert=training)
        if not training:  # read-only: no insert above, no graph, no backward
            return {name: torch.from_numpy(out) for name, out in pooled.items()}
        pending = _Pending(self.group, self.mode, inputs, list(pooled.values()), tensors)
        anchor = torch.empty(0, requires_grad=True)
        tracked = _LookupApply.apply(pending, anchor)  # type: ignore[no-untyped-call]
        return dict(zip(pending.names, tracked))
