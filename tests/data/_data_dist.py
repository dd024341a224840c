"""Multi-process runner for the data tests: the shared gloo launcher of tests/distributed."""

from __future__ import annotations

from tests.distributed.launch import run_distributed as run_gloo  # noqa: F401
