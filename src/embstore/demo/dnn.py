"""DeepFM in PyTorch over :class:`embstore.torch.EmbeddingBagCollection` (``--model dnn``).

The sparse part is the factorization machine of :mod:`embstore.demo.fm` (same tables:
``[w, u]`` per id, factors ``v = factor_scale * u``, fused Adagrad in the store); a small
MLP reads the concatenated factor vectors of all fields, and its output is added to the FM logit. The embeddings are updated
by the backward of the collection (one group apply per step); the MLP and the bias train
with ``torch.optim.Adam``.

torch runs with one intra-op thread by default (``torch_threads``): the MLP is small, and
on a busy machine torch's spinning OpenMP workers fight the store's worker threads (on the
2-core development VM, under load, a step took ~200 ms with 2 torch threads, ~3 ms with 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

import embstore
from embstore.demo.data import Batch
from embstore.torch import EmbeddingBagCollection

__all__ = ["DeepFM"]


class _Net(torch.nn.Module):
    def __init__(
        self,
        group: embstore.TableGroup,
        hidden: Sequence[int],
        bias: float,
        factor_scale: float,
    ) -> None:
        super().__init__()
        self.factor_scale = factor_scale
        self.fields = tuple(group.names)
        self.embeddings = EmbeddingBagCollection(group)
        dim = group[self.fields[0]].dim - 1
        layers: list[torch.nn.Module] = []
        width = len(self.fields) * dim
        for h in hidden:
            layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
            width = h
        layers.append(torch.nn.Linear(width, 1))
        self.mlp = torch.nn.Sequential(*layers)
        self.bias = torch.nn.Parameter(torch.tensor(float(bias)))

    def forward(self, batch: Batch) -> torch.Tensor:
        pooled = self.embeddings(batch.features)
        p = torch.stack([pooled[name] for name in self.fields])  # [F, B, dim + 1]
        linear = p[:, :, 0].sum(0)
        e = self.factor_scale * p[:, :, 1:]
        s = e.sum(0)
        pair = 0.5 * ((s * s).sum(1) - (e * e).sum((0, 2)))
        deep = self.mlp(e.permute(1, 0, 2).flatten(1)).squeeze(1)
        logits: torch.Tensor = self.bias + linear + pair + deep
        return logits


class DeepFM:
    """FM + MLP; ``group`` as built by :func:`embstore.demo.fm.build_group`."""

    def __init__(
        self,
        group: embstore.TableGroup,
        *,
        hidden: Sequence[int] = (64, 32),
        dense_lr: float = 1e-3,
        bias: float = 0.0,
        factor_scale: float = 1.0,
        seed: int = 0,
        torch_threads: int | None = 1,
    ) -> None:
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)  # process-wide: the demo owns its process
        torch.manual_seed(seed)
        self._group = group
        self.net = _Net(group, hidden, bias, factor_scale)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=dense_lr)

    @property
    def group(self) -> embstore.TableGroup:
        return self._group

    def train_step(self, batch: Batch) -> npt.NDArray[np.float32]:
        self.net.train()
        logits = self.net(batch)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, torch.from_numpy(batch.labels)
        )
        self.optimizer.zero_grad(set_to_none=True)
        torch.autograd.backward(loss)  # dense grads, and the store's fused Adagrad (one group call)
        self.optimizer.step()
        probabilities: npt.NDArray[np.float32] = torch.sigmoid(logits.detach()).numpy()
        return probabilities

    def predict(self, batch: Batch) -> npt.NDArray[np.float32]:
        self.net.eval()
        with torch.no_grad():  # read-only: nothing inserted or written
            probabilities: npt.NDArray[np.float32] = torch.sigmoid(self.net(batch)).numpy()
        return probabilities
