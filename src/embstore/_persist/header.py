"""A checkpoint header's table entry -> :class:`~embstore.TableSpec`."""

from __future__ import annotations

from typing import Any

from embstore.admission import CountFilter
from embstore.checkpoint import CheckpointError, CheckpointReader
from embstore.initializers import Initializer, Normal, TruncatedNormal, Uniform, Zeros
from embstore.optimizers import FTRL, SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad, state_layout
from embstore.spec import TableSpec

_OPTIMIZERS: dict[str, type[Any]] = {
    c.__name__: c for c in (SGD, Adagrad, RowWiseAdagrad, Adam, FTRL)
}
_INITIALIZERS: dict[str, type[Any]] = {
    c.__name__: c for c in (Zeros, Uniform, Normal, TruncatedNormal)
}


class HeaderView:
    """A checkpoint header read without its rows (what :class:`SavedTable` needs of a
    reader: the header and errors that name the file)."""

    def __init__(self, path: str, header: dict[str, Any]) -> None:
        self.path = path
        self.header = header

    def error(self, what: str) -> CheckpointError:
        """A CheckpointError about this file."""
        return CheckpointError(f"{self.path}: {what}")


def _build(
    kind: str, spec: Any, registry: dict[str, type[Any]], r: CheckpointReader | HeaderView
) -> Any:
    if not isinstance(spec, dict) or spec.get("type") not in registry:
        raise r.error(f"unknown {kind} in the header: {spec!r}")
    params = {k: v for k, v in spec.items() if k != "type"}
    try:
        return registry[spec["type"]](**params)
    except (TypeError, ValueError) as e:
        raise r.error(f"bad {kind} settings in the header: {e}") from None


class SavedTable:
    """A checked view of a checkpoint header's table configuration."""

    def __init__(self, r: CheckpointReader | HeaderView) -> None:
        h = r.header
        try:
            t = h["table"]
            self.name: str | None = t["name"]
            if self.name is not None and not isinstance(self.name, str):
                raise TypeError("name")
            self.dim = int(t["dim"])
            self.capacity = int(t["capacity"])
            self.num_shards = int(t["num_shards"])
            self.num_threads = None if t["num_threads"] is None else int(t["num_threads"])
            self.eviction = str(t["eviction"])
            self.step = int(t["step"])
            self.step_tracking = bool(t["step_tracking"])
            padding = t.get("padding_id")
            self.padding_id: int | None = None if padding is None else int(padding)
            self.row_width = int(h["row_width"])
            self.layout = [(str(a), int(b), str(c)) for a, b, c in h["state_layout"]]
            self.optimizer: Optimizer = _build("optimizer", t["optimizer"], _OPTIMIZERS, r)
            self.initializer: Initializer = _build(
                "initializer", t["initializer"], _INITIALIZERS, r
            )
            adm = t["admission"]
            self.admission: CountFilter | None = (
                None if adm is None else _build("admission", adm, {"CountFilter": CountFilter}, r)
            )
        except (KeyError, TypeError, ValueError) as e:
            raise r.error(f"corrupted header (bad table configuration: {e!r})") from None
        if self.layout != state_layout(
            self.optimizer, self.dim
        ) or self.row_width != self.dim + sum(w for _, w, _ in self.layout):
            raise r.error("corrupted header (state layout does not match the optimizer)")
        if h.get("kind") not in ("full", "delta"):
            raise r.error(f"corrupted header (unknown kind {h.get('kind')!r})")

    def same_table_shape(self, other: SavedTable) -> bool:
        """Whether rows of ``other`` fit a table of this configuration."""
        return (
            self.dim == other.dim
            and self.row_width == other.row_width
            and self.layout == other.layout
            and type(self.optimizer) is type(other.optimizer)
        )

    def spec(self, overrides: dict[str, Any]) -> TableSpec:
        """The saved table's spec, with ``overrides`` (checked by the caller) applied."""
        capacity = overrides.get("capacity", self.capacity)
        num_shards = overrides.get("num_shards", self.num_shards)
        if num_shards is None:
            num_shards = self.num_shards
        if "num_shards" not in overrides and int(num_shards) > int(capacity):
            num_shards = None  # a small capacity override: let the table choose
        return TableSpec(
            dim=self.dim,
            capacity=int(capacity),
            optimizer=self.optimizer,
            initializer=self.initializer,
            num_shards=num_shards,
            eviction=overrides.get("eviction", self.eviction),
            num_threads=overrides.get("num_threads", self.num_threads),
            name=overrides.get("name", self.name),
            admission=self.admission,
            on_evict=overrides.get("on_evict"),
            padding_id=self.padding_id,
        )
