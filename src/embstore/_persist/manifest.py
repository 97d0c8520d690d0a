"""A group checkpoint's manifest: its name, format and the file names it may hold."""

from __future__ import annotations

import re

MANIFEST = "MANIFEST.json"
GROUP_FORMAT = "embstore.group"
#: A table file of a group save, and a temporary file an interrupted save left behind.
FILE_RE = re.compile(r"^t\d{3}-[0-9a-f]{12}\.ckpt$")
TMP_RE = re.compile(r"^\..+\.[0-9a-f]{12}\.tmp$")
