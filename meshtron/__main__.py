"""``python -m meshtron <command>``: the same as the ``meshtron`` command."""

import sys

from meshtron.cli import main

if __name__ == "__main__":
    sys.exit(main())
