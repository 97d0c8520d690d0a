"""``python -m embstore.ps serve|load`` (see embstore.ps.cli)."""

from embstore.ps.cli import main

raise SystemExit(main())
