"""The error every layer of meshtron raises for bad user input.

It lives in a module of its own, with no imports, so that the configuration schema
(:mod:`meshtron.config`), its checks (:mod:`meshtron.validation`), the layer partition
(:mod:`meshtron.pipeline.partition`) and the launcher can all raise it without importing
each other. ``meshtron train`` prints its message as one line and exits with code 2.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration error. The message names the flag (or file) and what would be valid."""


__all__ = ["ConfigError"]
