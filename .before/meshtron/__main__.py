"""``python -m meshtron <command>``: the same as the ``meshtron`` command."""

import sys

from meshtron.cli import main
from meshtron.launcher import report_exit_status

if __name__ == "__main__":
    code = main()
    report_exit_status(code)  # read by the --nproc-per-node launcher after it forwarded a signal
    sys.exit(code)
