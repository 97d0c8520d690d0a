"""PyTorch front end: :class:`EmbeddingBagCollection`, a ``torch.nn.Module`` over a TableGroup.

Needs the optional extra ``embstore[torch]``; ``import embstore`` never imports torch.

The forward pools every feature's bags in ONE call into the store and returns tensors that
share memory with the store's output buffers. The backward applies every table's pooled
gradients in ONE call with each table's fused optimizer. Both calls are torch custom ops
(``embstore::lookup_sum``, ``embstore::apply_gradients``), so ``torch.compile`` traces a
model that uses the module. The rows are not torch Parameters: the dense part of a model
trains with any torch optimizer as usual, and ``state_dict()`` carries the rows and their
optimizer state. User guide: ``docs/torch.md``.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401  (the extra's one dependency)
except ImportError as exc:  # pragma: no cover - exercised in a subprocess without torch
    msg = (
        "embstore.torch needs PyTorch, which is not installed; install the extra with "
        'pip install "embstore[torch]"'
    )
    raise ImportError(msg) from exc

from embstore.torch._config import EmbeddingBagConfig
from embstore.torch._keyed import KeyedTensor
from embstore.torch._module import EmbeddingBagCollection

__all__ = ["EmbeddingBagCollection", "EmbeddingBagConfig", "KeyedTensor"]
