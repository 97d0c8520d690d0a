"""EmbeddingBagCollection's store calls as torch custom ops, so torch.compile traces them.

``embstore::lookup_sum`` pools the bags of every feature of a batch in ONE store call and
``embstore::apply_gradients`` (its backward) applies every table's gradient in ONE call
(:mod:`embstore.torch._packing` does the work). In eager mode :func:`lookup` takes a
shorter road to the same functions, a plain ``autograd.Function``: the custom op's
flattening of its list arguments is a large share of a many-table small-batch step.
"""

from __future__ import annotations

from typing import Any

import torch

from embstore.torch._packing import (
    Binding,
    apply_packed,
    check_once,
    feature_bags,
    lookup_packed,
    pack,
)

__all__ = ["lookup"]

Tensor = torch.Tensor


@torch.library.custom_op("embstore::lookup_sum", mutates_args=())
def lookup_sum(
    handle: int,
    features: list[int],
    counts: list[int],
    values: list[Tensor],
    lens: list[Tensor],
    is_lengths: list[int],
    weights: list[Tensor | None],
    bags: list[int],
    insert: bool,
    anchor: Tensor,
) -> tuple[list[Tensor], Tensor]:
    """Pooled outputs of every table the features read (one store call), and a ticket the
    backward marks as applied. ``anchor`` (an empty tensor) makes autograd record the op."""
    del anchor
    batch = pack(handle, features, counts, values, lens, is_lengths, weights, bags)
    return lookup_packed(batch, insert), torch.ones(1, dtype=torch.int64)


@lookup_sum.register_fake
def _lookup_sum_fake(
    handle: int,
    features: list[int],
    counts: list[int],
    values: list[Tensor],
    lens: list[Tensor],
    is_lengths: list[int],
    weights: list[Tensor | None],
    bags: list[int],
    insert: bool,
    anchor: Tensor,
) -> tuple[list[Tensor], Tensor]:
    binding = Binding.of(handle)
    rows: dict[int, Any] = {}
    for f, n in zip(features, feature_bags(counts, lens, is_lengths, bags), strict=True):
        t = binding.feature_table[f]
        rows[t] = rows.get(t, 0) + n
    outs = [anchor.new_empty((n, binding.tables[t].dim)) for t, n in rows.items()]
    return outs, anchor.new_empty((1,), dtype=torch.int64)


@torch.library.custom_op("embstore::apply_gradients", mutates_args=())
def apply_gradients(
    handle: int,
    features: list[int],
    counts: list[int],
    values: list[Tensor],
    lens: list[Tensor],
    is_lengths: list[int],
    weights: list[Tensor | None],
    bags: list[int],
    grads: list[Tensor | None],
    ticket: Tensor,
) -> Tensor:
    """The backward of :func:`lookup_sum`: every table's gradient in one store call. Returns
    the anchor's (empty) gradient, which keeps a compiled graph from dropping the op."""
    flag = ticket.numpy()  # written through numpy: no version bump, so autograd allows it
    check_once(flag[0] != 1)
    flag[0] = 0  # before applying: never twice, even after a failed apply
    batch = pack(handle, features, counts, values, lens, is_lengths, weights, bags)
    apply_packed(batch, grads)
    return torch.zeros(0)


@apply_gradients.register_fake
def _apply_gradients_fake(
    handle: int,
    features: list[int],
    counts: list[int],
    values: list[Tensor],
    lens: list[Tensor],
    is_lengths: list[int],
    weights: list[Tensor | None],
    bags: list[int],
    grads: list[Tensor | None],
    ticket: Tensor,
) -> Tensor:
    return ticket.new_empty((0,), dtype=torch.float32)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    handle, features, counts, values, lens, is_lengths, weights, bags, _, _ = inputs
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no update
    ctx.binding = Binding.of(handle)  # the graph keeps the store alive until the backward
    ctx.args = (handle, list(features), list(counts), list(is_lengths), list(bags))
    # the backward returns one None per input leaf: torch flattens lists of tensors only
    ctx.shapes = [
        len(a) if isinstance(a, list) and all(isinstance(x, torch.Tensor) for x in a) else None
        for a in inputs[:-1]
    ]
    ctx.weighted = [w is not None for w in weights]
    given = [w for w in weights if w is not None]
    ctx.save_for_backward(output[1], *values, *lens, *given)


def _backward(ctx: Any, grads: list[Tensor | None], _ticket: Any) -> tuple[Any, ...]:
    handle, features, counts, is_lengths, bags = ctx.args
    n = len(counts)
    saved = ctx.saved_tensors
    ticket, values, lens, given = (
        saved[0],
        saved[1 : 1 + n],
        saved[1 + n : 1 + 2 * n],
        saved[1 + 2 * n :],
    )
    it = iter(given)
    weights = [next(it) if flagged else None for flagged in ctx.weighted]
    anchor_grad = torch.ops.embstore.apply_gradients(
        handle,
        features,
        counts,
        list(values),
        list(lens),
        is_lengths,
        weights,
        bags,
        list(grads),
        ticket,
    )
    # one None per input leaf (list inputs get a list), the anchor's gradient last
    return (*(None if n is None else [None] * n for n in ctx.shapes), anchor_grad)


lookup_sum.register_autograd(_backward, setup_context=_setup_context)


class _EagerLookupSum(torch.autograd.Function):
    """Eager twin of the custom op with its autograd: the same packing and store calls,
    fewer layers, and the packed batch kept for the backward instead of packed again.

    Inputs: ``spec`` (the op's non-tensor arguments), the anchor, then every segment
    tensor, so autograd's version counters guard them until the backward."""

    @staticmethod
    def forward(ctx: Any, spec: tuple[Any, ...], anchor: Tensor, *tensors: Tensor) -> Any:
        del anchor
        handle, features, counts, is_lengths, bags, weighted = spec
        values, lens, weights = _unpack(tensors, len(counts), weighted)
        batch = pack(handle, features, counts, values, lens, is_lengths, weights, bags)
        outs = lookup_packed(batch, True)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: no update
        ctx.batch = batch  # holds the binding: the graph keeps the store alive
        ctx.applied = False
        ctx.save_for_backward(*tensors)
        return tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Any, ...]:
        tensors = ctx.saved_tensors  # raises if one was modified in place meanwhile
        check_once(ctx.applied)
        ctx.applied = True  # before applying: never twice, even after a failed apply
        batch, ctx.batch = ctx.batch, None
        apply_packed(batch, grads)
        return (None, None, *([None] * len(tensors)))


def _unpack(
    tensors: tuple[Tensor, ...], n: int, weighted: list[bool]
) -> tuple[list[Tensor], list[Tensor], list[Tensor | None]]:
    given = iter(tensors[2 * n :])
    weights = [next(given) if flag else None for flag in weighted]
    return list(tensors[:n]), list(tensors[n : 2 * n]), weights


def lookup(
    handle: int,
    features: list[int],
    counts: list[int],
    values: list[Tensor],
    lens: list[Tensor],
    is_lengths: list[int],
    weights: list[Tensor | None],
    bags: list[int],
    training: bool,
    anchor: Tensor,
) -> list[Tensor]:
    """The pooled output of each table the features read (tables in first-appearance order):
    the custom op while torch.compile traces, its eager twin otherwise. ``training``: insert
    missing ids and apply the gradients in the backward (``anchor`` must require grad)."""
    if torch.compiler.is_compiling():
        outs, _ = torch.ops.embstore.lookup_sum(
            handle, features, counts, values, lens, is_lengths, weights, bags, training, anchor
        )
        return list(outs)
    if not training:
        return lookup_packed(
            pack(handle, features, counts, values, lens, is_lengths, weights, bags), False
        )
    weighted = [w is not None for w in weights]
    spec = (handle, features, counts, is_lengths, bags, weighted)
    given = [w for w in weights if w is not None]
    return list(_EagerLookupSum.apply(spec, anchor, *values, *lens, *given))  # type: ignore[no-untyped-call]
