"""Context parallelism in one place: a sequence split over CP ranks, attention over the whole sequence.

- :mod:`meshtron.parallel.context_parallel.split`: which tokens a rank holds (two chunks each, mirrored, so that
  causal work is balanced) and how a micro-batch is cut to them;
- :mod:`meshtron.parallel.context_parallel.attention`: attention for this rank's queries against the keys and
  values of every rank (``p2p``: a ring of key/value blocks; ``allgather``: keys and values gathered once), with
  blocks merged exactly through their log-sum-exp;
- :mod:`meshtron.parallel.context_parallel.kernels`: the per-block attention kernels those schedules call
  (cuDNN, flash, math), each returning its output and log-sum-exp.
"""
