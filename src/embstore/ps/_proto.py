"""The protocol's message classes, built at import from ``embstore_ps.proto``.

grpcio-tools' bundled protoc compiles the proto into a descriptor set, and the installed
protobuf runtime builds the classes from it: no generated stubs are committed, so they can
never disagree with the proto or with the runtime's version.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

try:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from grpc_tools import protoc
except ImportError as e:  # pragma: no cover - exercised only without the extra
    msg = f"embstore.ps needs grpcio, grpcio-tools and protobuf: pip install 'embstore[ps]' ({e})"
    raise ImportError(msg) from e

__all__ = ["PROTO_PATH", "SERVICE", "messages"]

PROTO_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "embstore_ps.proto")
#: The service's full name: methods are ``/embstore.ps.EmbeddingPS/<Method>``.
SERVICE = "embstore.ps.EmbeddingPS"


def _compile() -> bytes:
    folder, fname = os.path.split(PROTO_PATH)
    with tempfile.TemporaryDirectory(prefix="embstore-ps-") as tmp:
        out = os.path.join(tmp, "embstore_ps.desc")
        rc = protoc.main(["protoc", f"-I{folder}", f"--descriptor_set_out={out}", fname])
        if rc != 0:
            msg = f"protoc failed ({rc}) compiling {PROTO_PATH}"
            raise RuntimeError(msg)
        with open(out, "rb") as f:
            return f.read()


def _build() -> dict[str, Any]:
    files = descriptor_pb2.FileDescriptorSet.FromString(_compile())
    pool = descriptor_pool.DescriptorPool()
    for f in files.file:
        pool.Add(f)
    fd = pool.FindFileByName("embstore_ps.proto")
    return {
        name: message_factory.GetMessageClass(desc)
        for name, desc in fd.message_types_by_name.items()
    }


#: Message classes by name (``messages["LookupRequest"]``).
messages: dict[str, Any] = _build()
