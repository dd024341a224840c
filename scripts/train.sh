#!/usr/bin/env bash
# Set up the environment if needed, then train: `bash scripts/train.sh [meshtron train flags]`.
# With no flags it trains the tiny preset on the built-in corpus on whatever device exists.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$MESHTRON_ROOT"
exec "$MESHTRON_PY" -m meshtron train "$@"
