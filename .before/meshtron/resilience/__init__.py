"""Resilience: fault injection for drills, hang detection with attribution, automatic restart.

- :mod:`~meshtron.resilience.faults`: ``--inject-fault KIND:RANK:ITERATION[:ARG]``;
- :mod:`~meshtron.resilience.hang`: the per-rank watchdog (``--hang-timeout-seconds``) that names
  the rank, group and collective a stuck job waits on;
- :mod:`~meshtron.resilience.restart`: restart attempts (``--max-restarts``) and where they resume.

See docs/resilience.md.
"""
