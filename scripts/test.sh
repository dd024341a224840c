#!/usr/bin/env bash
# Set up the environment if needed, then run the test suite: `bash scripts/test.sh [pytest arguments]`.
# With no arguments it runs everything under tests/ except the cases marked slow.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$MESHTRON_ROOT"
if [ "$#" -eq 0 ]; then
    # The whole suite less the cases marked slow (each layout keeps a fast representative);
    # `bash scripts/test.sh -m slow tests` runs those.
    set -- tests -m "not slow"
fi
exec "$MESHTRON_PY" -m pytest -x -q "$@"
