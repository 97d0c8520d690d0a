"""embstore.ps: a reference gRPC parameter server over a :class:`~embstore.TableGroup`, its
client, and a load generator (``python -m embstore.ps``). Needs the ``ps`` extra
(``pip install 'embstore[ps]'``: grpcio, grpcio-tools, protobuf); ``import embstore`` never
imports this package. See docs/ps.md.
"""

from __future__ import annotations

from embstore.ps._malloc import keep_freed_memory
from embstore.ps.client import Client, PSError, ServerHistogram, window
from embstore.ps.server import Server, serve

__all__ = ["Client", "PSError", "Server", "ServerHistogram", "keep_freed_memory", "serve", "window"]
