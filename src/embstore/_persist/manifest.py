"""A group checkpoint's manifest file (written and checked by the core)."""

from __future__ import annotations

MANIFEST = "MANIFEST.json"
