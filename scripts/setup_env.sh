#!/usr/bin/env bash
# Create the virtual environment (if missing) and install meshtron into it.
# Idempotent and fast when already set up. Used by scripts/train.sh and scripts/test.sh.
#
#   bash scripts/setup_env.sh
#
# Environment:
#   MESHTRON_VENV   where the environment lives (default: .venv in the repository)
#   PYTHON          the interpreter that creates it (default: python3; Python >= 3.10)
#   TORCH_SPEC      the torch requirement when torch is missing (default: torch==2.13.0, then any 2.11 to 2.14.1)
set -euo pipefail

MESHTRON_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MESHTRON_VENV="${MESHTRON_VENV:-$MESHTRON_ROOT/.venv}"
MESHTRON_PY="$MESHTRON_VENV/bin/python"

if [ ! -x "$MESHTRON_PY" ]; then
    base_python="${PYTHON:-python3}"
    if ! "$base_python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
        echo "setup_env: meshtron needs Python >= 3.10; set PYTHON=/path/to/python3.x" >&2
        exit 1
    fi
    echo "setup_env: creating $MESHTRON_VENV" >&2
    "$base_python" -m venv "$MESHTRON_VENV"
fi

# torch first, only when missing: an existing (e.g. CUDA) build is kept.
if ! "$MESHTRON_PY" -c 'import torch' 2>/dev/null; then
    echo "setup_env: installing torch" >&2
    if [ -n "${TORCH_SPEC:-}" ]; then
        "$MESHTRON_PY" -m pip install --quiet "$TORCH_SPEC"
    else
        "$MESHTRON_PY" -m pip install --quiet 'torch==2.13.0' 2>/dev/null \
            || "$MESHTRON_PY" -m pip install --quiet 'torch>=2.11,<=2.14.1'
    fi
fi

# meshtron itself (editable, with the test extras), again only when pyproject.toml changed since the last install.
stamp="$MESHTRON_VENV/.meshtron-install-stamp"
want="$(cksum < "$MESHTRON_ROOT/pyproject.toml") $MESHTRON_ROOT"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! "$MESHTRON_PY" -c 'import meshtron' 2>/dev/null; then
    echo "setup_env: installing meshtron (pip install -e '.[dev]')" >&2
    "$MESHTRON_PY" -m pip install --quiet -e "$MESHTRON_ROOT[dev]"
    printf '%s' "$want" > "$stamp"
fi
