"""Errors raised by the data pipeline."""

from __future__ import annotations

from meshtron.config import ConfigError


class DataError(ConfigError):
    """A user-facing problem with input data (a missing, corrupt or unreadable file, an empty split).

    It is a :class:`~meshtron.config.ConfigError`, so the command line prints it as one line and
    exits with code 2 instead of showing a traceback. The message names the file or flag involved.
    """
