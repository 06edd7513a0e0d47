"""``python -m packdata.cli``: the ``packdata`` command."""

from __future__ import annotations

import sys

from packdata.cli import main

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
