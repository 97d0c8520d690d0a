"""EmbeddingBagCollection: a ``torch.nn.Module`` over a TableGroup (or a store like one)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from embstore import _arrays
from embstore.table import Table
from embstore.torch import _state
from embstore.torch._config import (
    EmbeddingBagConfig,
    build_group,
    check_configs,
    configs_of_group,
)
from embstore.torch._inputs import batch_of
from embstore.torch._keyed import KeyedTensor
from embstore.torch._ops import lookup
from embstore.torch._packing import Binding, feature_bags

__all__ = ["EmbeddingBagCollection"]


def _is_backend(backend: Any) -> bool:
    return callable(getattr(backend, "lookup_sum", None)) and callable(
        getattr(backend, "apply_gradients", None)
    )


class EmbeddingBagCollection(torch.nn.Module):
    """Pooled embeddings of a :class:`~embstore.TableGroup`'s tables, with a fused backward.

    Build it from configs (TorchRec style), which creates the tables and the group::

        ebc = EmbeddingBagCollection.from_configs([
            EmbeddingBagConfig("items", 16, 100_000, ["item", "history"], pooling="mean"),
            EmbeddingBagConfig("users", 16, 10_000, ["user"]),
        ])

    or from a group of tables you made, where each table is a feature of its own name and
    every table pools by ``mode``: ``EmbeddingBagCollection(group, mode="sum")``.

    Parameters
    ----------
    group : TableGroup, or any object with its ``lookup_sum`` / ``apply_gradients``
        The store. ``lookup_sum({table: (keys, offsets[, weights])}, mode=, insert=)``
        must return ``{table: float32 [bags, dim]}`` and ``apply_gradients({table: (keys,
        offsets, grads[, weights])}, mode=)`` must apply them, as TableGroup's do (a sharded
        or remote store plugs in here). Without ``configs`` it must also be a mapping of
        table name -> table with ``dim``.
    mode : {"sum", "mean"}
        Pooling of every table, when ``configs`` is not given.
    configs : sequence of EmbeddingBagConfig, optional
        The tables (by ``name`` in ``group``), their features, pooling and padding ids.

    ``forward(features)`` takes a dict ``{feature: (keys, offsets[, weights])}``, a dict of
    ``{"values", "lengths" | "offsets"[, "weights"]}`` or JaggedTensor-like values, or a
    KeyedJaggedTensor-like object (see ``docs/torch.md``). It returns ``{feature: float32
    tensor [bags, dim]}`` for a dict, and a :class:`KeyedTensor` for a KeyedJaggedTensor.
    All features go to the store in ONE call; the backward applies every table's gradient
    in ONE call, with each table's fused optimizer.

    Rules:

    - Training forward (``module.training`` and grad mode on): missing ids are inserted;
      the gradients are applied once, when ``backward`` reaches the outputs. A forward
      that is never backpropagated applies nothing; a second backward through the same
      forward raises ``RuntimeError``. An output no loss depends on gets no update.
    - Eval forward (``eval()``, ``no_grad()``, ``inference_mode()``): read-only. Nothing is
      inserted (a missing id pools as zeros), nothing is written, no ``grad_fn``.
    - The rows are not Parameters (``parameters()`` is empty); ``state_dict()`` holds them
      and their optimizer state as tensors under ``tables.<name>.*``, and
      ``load_state_dict`` restores them (see ``docs/torch.md``).
    - Keys are used as given until the backward: do not modify them in place in between
      (torch raises for a modified tensor; a numpy array cannot be checked). Per-id
      weights are constants: weights that require grad raise.
    """

    def __init__(
        self,
        group: Any,
        *,
        mode: str = "sum",
        configs: Sequence[EmbeddingBagConfig] | None = None,
    ) -> None:
        super().__init__()
        if not _is_backend(group):
            msg = (
                "group must be an embstore.TableGroup or an object with TableGroup's "
                f"lookup_sum and apply_gradients, got {type(group).__name__}"
            )
            raise TypeError(msg)
        _arrays.mode_code(mode)  # ValueError for an unknown mode
        if configs is None:
            if not isinstance(group, Mapping):
                msg = "a group that is not a mapping of tables needs configs=[...]"
                raise TypeError(msg)
            configs = configs_of_group(group, mode)
        else:
            if mode != "sum":
                msg = "mode is for a group without configs; give each config its pooling"
                raise ValueError(msg)
            configs = check_configs(configs)
            _check_backend_tables(group, configs)
        self.mode = mode
        self._binding = Binding(group, configs)
        # autograd records the store ops only if an input requires grad; the rows are not
        # tensors, so an empty anchor does (its gradient is an empty tensor)
        self._anchor = torch.empty(0, requires_grad=True)
        self._no_anchor = torch.empty(0)

    @classmethod
    def from_configs(
        cls, configs: Sequence[EmbeddingBagConfig], *, backend: Any = None
    ) -> EmbeddingBagCollection:
        """A module with one new :class:`~embstore.Table` per config in a new
        :class:`~embstore.TableGroup` (or over ``backend``, a store that already holds
        tables of these names, e.g. a sharded or remote one)."""
        configs = check_configs(configs)
        return cls(build_group(configs) if backend is None else backend, configs=configs)

    @property
    def group(self) -> Any:
        """The store: the :class:`~embstore.TableGroup` (or the backend given)."""
        return self._binding.backend

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        """The tables' configs (for a module built from a group: one per table, whose
        feature is the table's name)."""
        return list(self._binding.configs)

    def feature_names(self) -> list[str]:
        """Every feature the module reads, table by table."""
        return list(self._binding.features)

    def output_dims(self) -> dict[str, int]:
        """``{feature: width of its pooled output}``."""
        return {
            f: self._binding.tables[t].dim
            for f, t in zip(self._binding.features, self._binding.feature_table, strict=True)
        }

    @property
    def output_dim(self) -> int:
        """Total width of all features' outputs side by side (``KeyedTensor.values()``)."""
        return sum(self.output_dims().values())

    def extra_repr(self) -> str:
        lines = []
        for config in self._binding.configs:
            table = self.group.get(config.name) if isinstance(self.group, Mapping) else None
            size = ""
            # a store's entries may be specs (a sharded store): only a live table has a size
            if isinstance(table, Table) and not table.closed:
                size = f", rows={len(table)}/{config.num_embeddings}"
            optimizer = getattr(table, "optimizer", config.optimizer)
            pad = "" if config.padding_id is None else f", padding_id={config.padding_id}"
            lines.append(
                f"{config.name}: dim={config.embedding_dim}, pooling={config.pooling!r}, "
                f"features={list(config.feature_names)}{pad}{size}, optimizer={optimizer!r}"
            )
        return "tables:\n  " + "\n  ".join(lines)

    def forward(self, features: Any) -> dict[str, torch.Tensor] | KeyedTensor:
        batch = batch_of(features, self._binding.feature_index)
        if not batch.names:
            return KeyedTensor([], []) if batch.keyed else {}
        training = self.training and torch.is_grad_enabled()
        outs = lookup(
            self._binding.handle,
            batch.features,
            batch.counts,
            batch.values,
            batch.lens,
            batch.is_lengths,
            batch.weights,
            batch.bags,
            training,
            self._anchor if training else self._no_anchor,
        )
        per_table = dict(zip(self._binding.tables_of(batch.features), outs, strict=True))
        readers: dict[int, int] = {}
        for f in batch.features:
            t = self._binding.feature_table[f]
            readers[t] = readers.get(t, 0) + 1
        pooled: list[torch.Tensor] = []
        start: dict[int, Any] = {}
        sizes = feature_bags(batch.counts, batch.lens, batch.is_lengths, batch.bags)
        for f, n in zip(batch.features, sizes, strict=True):
            t = self._binding.feature_table[f]
            if readers[t] == 1:
                pooled.append(per_table[t])
            else:  # features sharing a table: their bags are back to back in its output
                at = start.get(t, 0)
                pooled.append(per_table[t].narrow(0, at, n))
                start[t] = at + n
        if batch.keyed:
            return KeyedTensor(batch.names, pooled)
        return dict(zip(batch.names, pooled, strict=True))

    # -- state_dict: the tables' rows and optimizer state ---------------------------------
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        _state.save_tables(self.group, destination, prefix)

    def _load_from_state_dict(
        self,
        state_dict: Any,
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        root = prefix + "tables."
        rest = {k: v for k, v in state_dict.items() if not k.startswith(root)}
        super()._load_from_state_dict(
            rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        _state.load_tables(
            self.group, state_dict, prefix, missing_keys, unexpected_keys, error_msgs
        )


def _backend_dims(backend: Any) -> Mapping[str, Any] | None:
    """``{table: dim}`` of a store that says: a mapping of tables with ``dim`` (TableGroup,
    ShardedTableGroup), or a ``dims`` mapping (``embstore.ps.Client``); else None."""
    if isinstance(backend, Mapping):
        return {name: getattr(table, "dim", None) for name, table in backend.items()}
    dims = getattr(backend, "dims", None)
    return dims if isinstance(dims, Mapping) else None


def _check_backend_tables(backend: Any, configs: Sequence[EmbeddingBagConfig]) -> None:
    """A store that knows its tables must hold every config's table, with its dim."""
    dims = _backend_dims(backend)
    if dims is None:
        return
    for config in configs:
        if config.name not in dims:
            msg = f"configs: the group has no table {config.name!r}; it has {list(dims)}"
            raise KeyError(msg)
        dim = dims[config.name]
        if dim is not None and dim != config.embedding_dim:
            msg = (
                f"configs: table {config.name!r} has dim {dim}, its config says "
                f"embedding_dim={config.embedding_dim}"
            )
            raise ValueError(msg)
