#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite: `bash scripts/test.sh [pytest arguments]`.
# With no arguments it runs everything under tests/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$MESHTRON_ROOT"
if [ "$#" -eq 0 ]; then
    set -- tests
fi
exec "$MESHTRON_PY" -m pytest -x -q "$@"
