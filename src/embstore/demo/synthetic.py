"""The demo's default data: a synthetic CTR stream that a factorization machine can learn.

Every example has one id per field. Field ``f`` has a vocabulary of ``VOCAB[f % 8]``
values drawn by a Zipf law (exponent :data:`ZIPF`; the hottest values carry most of the
traffic, as in real logs), and value rank ``r`` of field ``f`` is the uint64 id
``splitmix64(r + (f << 32))``. Labels come from a hidden logistic model with first-order
and pairwise terms, the model class of a factorization machine:

    logit = bias + sum_f w[f, x_f] + sum_{f < g} <v[f, x_f], v[g, x_g]>

with ``w ~ N(0, W_STD**2)`` and ``v ~ N(0, V_STD**2)`` of dimension :data:`RANK`, and
``label ~ Bernoulli(sigmoid(logit))``. The hidden model's own AUC on the held-out part is
the best any model can do on that data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from embstore.bench import splitmix64, zipf_cdf
from embstore.demo.data import CTRData

__all__ = ["RANK", "VOCAB", "ZIPF", "Synthetic", "synthetic"]

#: Vocabulary of field ``f`` is ``VOCAB[f % len(VOCAB)]``.
VOCAB = (50_000, 20_000, 5_000, 2_000, 1_000, 300, 100, 20)
ZIPF = 1.1
RANK = 4
W_STD = 0.5
V_STD = 0.35
#: Hidden bias: about a quarter of the examples are positive.
BIAS = -1.5


@dataclass(frozen=True)
class Synthetic:
    """The generated examples, and the hidden model's logit of each."""

    data: CTRData
    logits: npt.NDArray[np.float32]


def synthetic(examples: int, fields: int = 8, seed: int = 0) -> Synthetic:
    """``examples`` examples of ``fields`` fields, deterministic per ``seed``."""
    if examples <= 0 or fields <= 0:
        msg = f"examples and fields must be positive, got {examples} and {fields}"
        raise ValueError(msg)
    rng = np.random.default_rng(seed)
    ids = np.empty((fields, examples), dtype=np.uint64)
    logits = np.full(examples, BIAS, dtype=np.float64)
    pooled = np.zeros((examples, RANK), dtype=np.float64)
    squares = np.zeros(examples, dtype=np.float64)
    for f in range(fields):
        vocab = VOCAB[f % len(VOCAB)]
        ranks = np.searchsorted(zipf_cdf(vocab, ZIPF), rng.random(examples))
        w = rng.normal(0.0, W_STD, vocab)
        v = rng.normal(0.0, V_STD, (vocab, RANK))
        ids[f] = splitmix64(ranks.astype(np.uint64) + np.uint64(f << 32))
        logits += w[ranks]
        vf = v[ranks]
        pooled += vf
        squares += np.einsum("ij,ij->i", vf, vf)
    # sum_{f<g} <v_f, v_g> = (|sum_f v_f|^2 - sum_f |v_f|^2) / 2
    logits += 0.5 * (np.einsum("ij,ij->i", pooled, pooled) - squares)
    labels = (rng.random(examples) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
    data = CTRData(labels=labels, ids=ids, fields=tuple(f"field{f}" for f in range(fields)))
    return Synthetic(data=data, logits=logits.astype(np.float32))
