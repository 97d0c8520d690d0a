"""Thin wrapper: ``python bench/run.py [flags]`` is ``python -m embstore bench [flags]``.

The runner lives in the package (:mod:`embstore.bench`) so that it also works from an
installed wheel; see bench/README.md for the method and the flags.
"""

from __future__ import annotations

import sys

from embstore.bench import main

if __name__ == "__main__":
    sys.exit(main())
