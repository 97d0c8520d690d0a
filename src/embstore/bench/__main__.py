"""``python -m embstore.bench [flags]`` is ``python -m embstore bench [flags]``."""

import sys

from embstore.bench import main

sys.exit(main())
