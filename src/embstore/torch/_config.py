"""EmbeddingBagConfig: one table of an EmbeddingBagCollection, TorchRec style."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from embstore import _arrays
from embstore.group import TableGroup
from embstore.initializers import Initializer
from embstore.optimizers import Optimizer
from embstore.table import Table

__all__ = ["EmbeddingBagConfig"]

_POOLINGS = ("sum", "mean")
_ID_RANGE = (-(2**63), 2**64)


@dataclass(frozen=True)
class EmbeddingBagConfig:
    """One embedding table and the features that read it.

    Parameters
    ----------
    name : str
        The table's name (its key in the :class:`~embstore.TableGroup` and in
        ``state_dict``).
    embedding_dim : int
        Floats per row (the width of each of its features' pooled outputs).
    num_embeddings : int
        Capacity: most rows the table holds (ids are hashed, any uint64 works; CLOCK evicts
        when full unless ``table_options`` says ``eviction="none"``).
    feature_names : sequence of str
        The input features pooled from this table. Several features may share one table;
        a feature belongs to one table.
    pooling : {"sum", "mean"}
        How each bag is reduced. Each table has its own.
    optimizer, initializer : optional
        As for :class:`~embstore.Table` (defaults ``Adagrad(lr=0.01)`` and
        ``Normal(std=0.01, seed=0)``).
    padding_id : int, optional
        An id that stands for "nothing" (e.g. ``-1``): it contributes nothing to its bag (and
        is not counted by ``"mean"``), gets no row and no update. Compared as uint64, as keys
        are (so ``-1`` matches int64 ``-1`` keys and uint64 ``2**64 - 1``).
    table_options : mapping, optional
        More keywords for :class:`~embstore.Table` (``num_shards``, ``eviction``,
        ``num_threads``, ``admission``, ``on_evict``).
    """

    name: str
    embedding_dim: int
    num_embeddings: int
    feature_names: Sequence[str]
    pooling: str = "sum"
    optimizer: Optimizer | None = None
    initializer: Initializer | None = None
    padding_id: int | None = None
    table_options: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            msg = f"name must be a non-empty str, got {self.name!r}"
            raise TypeError(msg)
        where = f"EmbeddingBagConfig {self.name!r}"
        for arg in ("embedding_dim", "num_embeddings"):
            try:
                _arrays.positive_int(arg, getattr(self, arg))
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: {exc}") from None
        names = self.feature_names
        if isinstance(names, str) or not isinstance(names, Sequence):
            msg = f"{where}: feature_names must be a sequence of str, got {names!r}"
            raise TypeError(msg)
        if not names or not all(isinstance(n, str) and n for n in names):
            msg = f"{where}: feature_names must hold one or more non-empty str, got {names!r}"
            raise ValueError(msg)
        if len(set(names)) != len(names):
            msg = f"{where}: feature_names has duplicates: {list(names)}"
            raise ValueError(msg)
        object.__setattr__(self, "feature_names", tuple(names))
        if self.pooling not in _POOLINGS:
            msg = f"{where}: pooling must be 'sum' or 'mean', got {self.pooling!r}"
            raise ValueError(msg)
        pad = self.padding_id
        if pad is not None:
            if isinstance(pad, bool) or not isinstance(pad, int):
                msg = f"{where}: padding_id must be an int or None, got {pad!r}"
                raise TypeError(msg)
            if not _ID_RANGE[0] <= pad < _ID_RANGE[1]:
                msg = f"{where}: padding_id must be in [-2**63, 2**64), got {pad}"
                raise ValueError(msg)
        if not isinstance(self.table_options, Mapping):
            msg = f"{where}: table_options must be a mapping, got {self.table_options!r}"
            raise TypeError(msg)
        clash = {"dim", "capacity", "optimizer", "initializer"} & set(self.table_options)
        if clash:
            msg = f"{where}: table_options must not set {sorted(clash)} (fields of the config)"
            raise ValueError(msg)
        object.__setattr__(self, "table_options", dict(self.table_options))

    @property
    def padding_key(self) -> int | None:
        """``padding_id`` as the uint64 the store compares keys with."""
        return None if self.padding_id is None else self.padding_id % 2**64

    def build_table(self) -> Table:
        """A new :class:`~embstore.Table` for this config."""
        return Table(
            dim=self.embedding_dim,
            capacity=self.num_embeddings,
            optimizer=self.optimizer,
            initializer=self.initializer,
            **self.table_options,
        )


def check_configs(configs: Sequence[EmbeddingBagConfig]) -> list[EmbeddingBagConfig]:
    """``configs`` as a list, checked: configs, distinct table names, each feature once."""
    if isinstance(configs, EmbeddingBagConfig) or not isinstance(configs, Sequence):
        msg = f"configs must be a sequence of EmbeddingBagConfig, got {type(configs).__name__}"
        raise TypeError(msg)
    if not configs:
        msg = "configs must hold at least one EmbeddingBagConfig"
        raise ValueError(msg)
    tables: set[str] = set()
    owner: dict[str, str] = {}
    for k, config in enumerate(configs):
        if not isinstance(config, EmbeddingBagConfig):
            msg = f"configs[{k}] must be an EmbeddingBagConfig, got {type(config).__name__}"
            raise TypeError(msg)
        if config.name in tables:
            msg = f"configs: two tables are named {config.name!r}"
            raise ValueError(msg)
        tables.add(config.name)
        for feature in config.feature_names:
            if feature in owner:
                msg = (
                    f"configs: feature {feature!r} is read by tables {owner[feature]!r} and "
                    f"{config.name!r}; a feature belongs to one table"
                )
                raise ValueError(msg)
            owner[feature] = config.name
    return list(configs)


def build_group(configs: Sequence[EmbeddingBagConfig]) -> TableGroup:
    """A new :class:`~embstore.TableGroup` with one table per config."""
    return TableGroup({config.name: config.build_table() for config in configs})


def configs_of_group(backend: Any, mode: str) -> list[EmbeddingBagConfig]:
    """One config per table of ``backend`` (a mapping of name -> table with ``dim``): the
    feature of each table is the table itself, as :class:`EmbeddingBagCollection` reads a
    group it is given directly."""
    configs = []
    for name, table in backend.items():
        configs.append(
            EmbeddingBagConfig(
                name=name,
                embedding_dim=int(table.dim),
                num_embeddings=int(getattr(table, "capacity", 1)),
                feature_names=(name,),
                pooling=mode,
                optimizer=getattr(table, "optimizer", None),
                initializer=getattr(table, "initializer", None),
            )
        )
    return configs
