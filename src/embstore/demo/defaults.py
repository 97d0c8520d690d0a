"""The demo's default hyperparameters, and the two that follow the number of fields.

A factorization machine's logit sums one first-order term per field and one pairwise term
per pair of fields, and Adagrad's first steps move every new row by about its learning rate
whatever the gradient. On data with many fields and few examples per id (39 fields and
8,000 rows of Criteo) those first steps of rare ids add up to noise that drowns the signal,
so the first-order learning rate falls as ``1 / fields`` and the factors' step as
``1 / pairs of fields`` beyond :data:`REFERENCE_FIELDS`. Up to that many fields the defaults
are the fixed values. docs/demo.md has the holdout runs that chose them.
"""

from __future__ import annotations

__all__ = ["DEFAULTS", "REFERENCE_FIELDS", "default_factor_scale", "default_lr"]

#: Fixed defaults of the command line.
DEFAULTS = {
    "epochs": 1,
    "batch_size": 256,
    "dim": 32,
    "init_std": 0.01,
    "examples": 500_000,
    "fields": 8,
}
#: Adagrad learning rate of the tables up to :data:`REFERENCE_FIELDS` fields.
BASE_LR = 0.1
#: Data with at most this many fields (the synthetic stream's 8, Frappe's 10) keeps
#: ``BASE_LR`` and a factor scale of 1.
REFERENCE_FIELDS = 10


def _pairs(fields: int) -> int:
    return fields * (fields - 1) // 2


def default_lr(fields: int) -> float:
    """Adagrad learning rate of the tables: ``0.1 * min(1, 10 / fields)``."""
    if fields <= 0:
        msg = f"fields must be positive, got {fields}"
        raise ValueError(msg)
    return BASE_LR * min(1.0, REFERENCE_FIELDS / fields)


def default_factor_scale(fields: int) -> float:
    """Scale of the factors against the first-order weights (their relative step size):
    ``min(1, 45 / pairs)``, with 45 the pairs of 10 fields."""
    if fields <= 0:
        msg = f"fields must be positive, got {fields}"
        raise ValueError(msg)
    if fields <= REFERENCE_FIELDS:
        return 1.0
    return _pairs(REFERENCE_FIELDS) / _pairs(fields)
