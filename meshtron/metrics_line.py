"""One line of the metrics file (a contract, docs/metrics.md): a JSON object of plain numbers, NaN/inf written as
null with ``"nonfinite": true``.

The logging sinks (:mod:`meshtron.training.logging_sinks`) and the hang watchdog (:mod:`meshtron.resilience.hang`),
which adds its event to the same file, both write lines this way; it sits below both.
"""

from __future__ import annotations

import json
import math
from typing import Any


def _is_nonfinite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def to_json_line(record: dict) -> str:
    """One metrics-file line: NaN/inf become null and the record gains ``"nonfinite": true``."""
    out = {k: (None if _is_nonfinite(v) else v) for k, v in record.items()}
    if any(_is_nonfinite(v) for v in record.values()):
        out["nonfinite"] = True
    return json.dumps(out, allow_nan=False, separators=(",", ":"))
