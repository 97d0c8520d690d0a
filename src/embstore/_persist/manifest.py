"""A group checkpoint manifest: its file name, and the CRC-sealed JSON body of one."""

from __future__ import annotations

import json
import zlib
from typing import Any

MANIFEST = "MANIFEST.json"


def seal(body: Any) -> bytes:
    """A manifest file's bytes: ``body`` with the CRC-32 of its canonical JSON."""
    text = json.dumps(body, sort_keys=True)
    return json.dumps({"body": body, "crc32": zlib.crc32(text.encode()) & 0xFFFFFFFF}).encode()


def unseal(raw: bytes) -> Any:
    """The body of :func:`seal`'s bytes. Raises ValueError, KeyError, TypeError or
    UnicodeDecodeError when ``raw`` is not such a manifest or its checksum fails."""
    manifest = json.loads(raw.decode())
    body = manifest["body"]
    text = json.dumps(body, sort_keys=True)
    if zlib.crc32(text.encode()) & 0xFFFFFFFF != manifest["crc32"]:
        raise ValueError("checksum")
    return body
