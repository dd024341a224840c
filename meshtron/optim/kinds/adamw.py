"""``--optimizer adam``: AdamW with decoupled weight decay (:mod:`meshtron.optim.optimizer`,
:mod:`meshtron.optim.segment_adam`), elementwise, so the distributed optimizer may cut its state anywhere."""

from __future__ import annotations

from meshtron.optim.registry import ELEMENTS, OptimizerKind


def _states(pieces) -> tuple[str, ...]:
    from meshtron.optim.optimizer import STATES

    return STATES


def moment_bytes(cfg) -> int:
    """Bytes per element of Adam's two moments (``--exp-avg-dtype``, ``--exp-avg-sq-dtype``)."""
    return sum(2 if d == "bf16" else 4 for d in (cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype))


def _build(params, cfg, ctx):
    from meshtron.optim.optimizer import MixedPrecisionAdamW

    return MixedPrecisionAdamW(params, cfg)


def _partitions(segments, params, grad_data, param_data, cfg, ctx, host):
    from meshtron.optim.segment_adam import SegmentAdamW

    return [SegmentAdamW(segments, grad_data, param_data, cfg, host=host)]


KIND = OptimizerKind(name="adam", layout=ELEMENTS, state_names=_states,
                     state_bytes=lambda cfg, pieces: moment_bytes(cfg), build=_build, partitions=_partitions,
                     description="AdamW (decoupled weight decay); state: master, exp_avg, exp_avg_sq")
