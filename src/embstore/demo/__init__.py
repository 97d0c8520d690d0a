"""``python -m embstore demo``: a CTR model trained through embstore tables, end to end.

- :mod:`~embstore.demo.data`: the in-memory data set and its mini-batches (one bag per
  example per field).
- :mod:`~embstore.demo.synthetic`: the default data, a learnable synthetic CTR stream.
- :mod:`~embstore.demo.readers`: Criteo TSV and libFM readers.
- :mod:`~embstore.demo.fm`: a factorization machine in numpy over a TableGroup.
- :mod:`~embstore.demo.dnn`: DeepFM in torch over :class:`embstore.torch.EmbeddingBagCollection`.
- :mod:`~embstore.demo.defaults`: the default hyperparameters (learning rate and factor
  scale follow the number of fields).
- :mod:`~embstore.demo.train`: the training loop and the held-out evaluation.
- :mod:`~embstore.demo.evaluation`: AUC and logloss.
- :mod:`~embstore.demo.report`: log lines, progress bar, plot.
- :mod:`~embstore.demo.cli`: the command line.

Only numpy is needed (torch for ``--model dnn``, matplotlib for ``--plot``).
"""

from __future__ import annotations

from embstore.demo.cli import main

__all__ = ["main"]
