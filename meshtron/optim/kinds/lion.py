"""``--optimizer lion``: the sign of a momentum interpolation, one state per parameter (Chen et al., 2023).

Megatron-LM's ``--optimizer lion`` with ``--lion-beta1`` (default 0.95) and ``--lion-beta2`` (0.98), for every
parameter; decoupled weight decay ``--weight-decay`` (none for norms and biases, as for AdamW). Its update has
the same size in every element (the learning rate), so Lion's learning rates are some 3-10x below AdamW's.
The step is elementwise (:mod:`meshtron.optim.lion_update`), so the distributed optimizer may cut its state
anywhere (layout need :data:`~meshtron.optim.registry.ELEMENTS`). Its state lives on the device (no
``--optimizer-cpu-offload``).
"""

from __future__ import annotations

from meshtron.optim.registry import ELEMENTS, OptimizerKind


def _states(pieces) -> tuple[str, ...]:
    return ("master", "exp_avg")


def _check(cfg) -> None:
    from meshtron.errors import ConfigError

    o = cfg.optim
    if o.optimizer_cpu_offload:
        raise ConfigError("--optimizer lion with --optimizer-cpu-offload is not implemented: Lion's step runs on "
                          "the device")
    for flag, beta in (("--lion-beta1", o.lion_beta1), ("--lion-beta2", o.lion_beta2)):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"{flag} must be in [0, 1), got {beta}")


def _build(params, cfg, ctx):
    from meshtron.optim.lion_update import MixedPrecisionLion

    return MixedPrecisionLion(params, cfg)


def _partitions(segments, params, grad_data, param_data, cfg, ctx, host):
    from meshtron.optim.lion_update import SegmentLion

    if host:  # asked for the host's share too, empty without --optimizer-cpu-offload (which _check refuses)
        if any(s.length for s in segments):
            raise ValueError("Lion's state is not offloaded to the host")
        return []
    return [SegmentLion(segments, grad_data, param_data, cfg)]


KIND = OptimizerKind(name="lion", layout=ELEMENTS, state_names=_states, state_bytes=lambda cfg, pieces: 4,
                     build=_build, partitions=_partitions, check=_check,
                     description="Lion (sign of an interpolated momentum); state: master, exp_avg")
