"""W5's tables: the 26 Criteo Kaggle cardinalities, each warmed in a random permutation.

W5 (bench/README.md) is the shape of real CTR models: many tables of very different sizes, a
small dim and small batches. Its key stream is W1's, drawn per table over the table's own
cardinality; what differs is the table sizes and the warm-up order, a fixed random
permutation of each table's ranks (W1's ``r * 618033 mod U`` is no permutation for most of
these sizes). Batches and gradients come from :func:`embstore.bench.workload.make_workload`.
"""

from __future__ import annotations

import numpy as np

from embstore.bench.workload import TableData, splitmix64

#: Rows of the 26 categorical tables of Criteo Kaggle, as DLRM uses them (33,762,577 in all).
CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
#: W5's dim and batch sizes (the first is the headline).
W5_DIM = 16
W5_BATCH_SIZES = (512, 128)
#: Seed of the warm-up permutations (fixed: the same rows for every run and peer).
PERMUTATION_SEED = 5


def w5_cardinalities(max_rows: int | None = None, num_tables: int | None = None) -> list[int]:
    """W5's table sizes: the first ``num_tables`` (default all 26) Criteo cardinalities,
    each capped at ``max_rows`` (default: no cap) so that tests and quick runs can shrink
    the large tables while the small ones keep their real sizes."""
    cards = list(CRITEO_CARDINALITIES[: num_tables or len(CRITEO_CARDINALITIES)])
    if max_rows is None:
        return cards
    if max_rows <= 0:
        msg = f"max_rows must be positive, got {max_rows}"
        raise ValueError(msg)
    return [min(c, max_rows) for c in cards]


def permutation(table: int, universe: int) -> np.ndarray:
    """Table ``table``'s warm-up permutation: ``row[r]`` is where rank ``r`` goes (its
    position in the warm-up order and its dense row), from a fixed seed."""
    rng = np.random.default_rng([PERMUTATION_SEED, table, universe])
    return rng.permutation(universe).astype(np.int64)


def make_w5_tables(max_rows: int | None = None, num_tables: int | None = None) -> list[TableData]:
    """W5's tables: ids ``splitmix64(r + (t << 32))`` of every rank ``r`` of table ``t``
    and the permuted placement (``warm_ids[row[r]] == ids[r]``); see
    :func:`w5_cardinalities` for ``max_rows`` and ``num_tables``."""
    tables = []
    for t, card in enumerate(w5_cardinalities(max_rows, num_tables)):
        ids = splitmix64(np.arange(card, dtype=np.uint64) + np.uint64(t << 32))
        row = permutation(t, card)
        warm = np.empty_like(ids)
        warm[row] = ids
        tables.append(TableData(index=t, ids=ids, row=row, warm_ids=warm))
    return tables
