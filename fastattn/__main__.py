"""``python -m fastattn``: the same command as the ``fastattn`` console script (fastattn.cli)."""

import sys

from fastattn.cli import main

if __name__ == "__main__":
    sys.exit(main())
