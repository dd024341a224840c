"""One module per ``--optimizer`` choice, each defining ``KIND`` (:class:`meshtron.optim.registry.OptimizerKind`)."""
