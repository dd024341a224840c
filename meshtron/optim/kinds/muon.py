"""``--optimizer muon``: momentum orthogonalised by a Newton-Schulz iteration, for the hidden matrices.

For every canonical weight matrix ``W`` (m x n) of the transformer layers (attention q, k, v, o, MLP gate,
up, down, experts' matrices, MLA projections) with reduced gradient ``G``, at learning rate ``lr``::

    M <- mu M + (1 - mu) G                       (--muon-momentum mu, the state "momentum_buffer")
    U <- (1 - mu) G + mu M  with --muon-nesterov, else M
    O <- NS(U)                                   (--muon-num-ns-steps quintic iterations, below)
    W <- W (1 - lr wd) - lr s O                  (decoupled weight decay --weight-decay wd)

``NS`` normalises ``U`` by its Frobenius norm (+1e-7), works on the wide orientation (``X`` with m <= n) and
iterates ``A = X X^T``, ``X <- a X + (b A + c A A) X`` with ``(a, b, c) = (3.4445, -4.7750, 2.0315)``, which
drives every singular value toward 1. The scale ``s`` is ``--muon-extra-scale-factor`` times
``sqrt(max(m, n))`` (``--muon-scale-mode spectral``), ``sqrt(m / n)`` (``unit_rms_norm``) or
``sqrt(max(1, m / n))`` (``shape_scaling``); spectral with 0.2 gives updates of AdamW's RMS (Moonlight's rule).

Everything else falls back to AdamW (with the AdamW flags and the same learning rate): the word and
position embeddings, the output layer, MoE routers, and every tensor that is not a matrix (norms,
biases). The rule reads the parameter's canonical pieces only, so it is the same in every layout.

Each canonical matrix is orthogonalised on its own: a fused local parameter (q, k and v; gate and up)
is split into its pieces first. A matrix split by tensor parallelism is all-gathered over the TP group
and every TP rank orthogonalises it whole and keeps its own rows or columns (``--muon-tp-mode
duplicated``, equal to one process; ``blockwise`` orthogonalises each TP shard on its own instead).
With a sharded optimizer (``--use-distributed-optimizer``, ZeRO-2/3) the layout gives every parameter
one owner among the data-parallel ranks (layout need :data:`~meshtron.optim.registry.WHOLE`), which
alone updates it; the weights' all-gather brings it to the others.

The update itself (torch) lives in :mod:`meshtron.optim.muon_update` and the rule of which tensors Muon updates
in :mod:`meshtron.optim.muon_rule`, below both; this module stays torch-free so that checking a configuration
imports no torch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

from meshtron.layer_kinds.base import Matrix
from meshtron.layer_kinds.pattern import LayerKinds, layer_kinds
from meshtron.optim.muon_rule import STATES, updates_matrix, uses_muon
from meshtron.optim.registry import WHOLE, OptimizerKind, StepWork

#: The names of a layer's two parts (``TransformerLayer.attention`` and ``.mlp``), which its matrices' names
#: begin with.
MIXER_PART, MLP_PART = "attention.", "mlp."


def _states(pieces) -> tuple[str, ...]:
    from meshtron.optim.optimizer import STATES as ADAMW_STATES

    return STATES if uses_muon(pieces) else ADAMW_STATES


def _state_bytes(cfg, pieces) -> int:
    from meshtron.optim.kinds.adamw import moment_bytes

    return 4 if uses_muon(pieces) else moment_bytes(cfg)


# ----------------------------------------------------------------------------------------- checks and costs
def _check(cfg) -> None:
    from meshtron.errors import ConfigError

    o = cfg.optim
    if o.optimizer_cpu_offload:
        raise ConfigError("--optimizer muon with --optimizer-cpu-offload is not implemented: Muon's step runs on "
                          "the device")
    if not 0.0 <= o.muon_momentum < 1.0:
        raise ConfigError(f"--muon-momentum must be in [0, 1), got {o.muon_momentum}")
    if o.muon_num_ns_steps < 1:
        raise ConfigError(f"--muon-num-ns-steps must be at least 1, got {o.muon_num_ns_steps}")
    if not (math.isfinite(o.muon_extra_scale_factor) and o.muon_extra_scale_factor > 0):
        raise ConfigError(f"--muon-extra-scale-factor must be positive, got {o.muon_extra_scale_factor}")


def layer_matrices(m, kinds: LayerKinds) -> list[Matrix]:
    """The canonical matrices Muon updates of one layer of ``kinds``, as its mixer and MLP kinds describe them,
    named relative to the layer (``attention.q.weight``; routers left to AdamW)."""
    described = ([replace(x, name=MIXER_PART + x.name) for x in kinds.mixer.matrices(m)]
                 + [replace(x, name=MLP_PART + x.name) for x in kinds.mlp.matrices(m)])
    return [x for x in described if updates_matrix(x.name)]


def ns_flops(rows: int, cols: int, steps: int) -> float:
    """Matmul FLOPs of ``steps`` quintic iterations on a rows x cols matrix (X X^T, A A, B X)."""
    small, large = min(rows, cols), max(rows, cols)
    return steps * (4.0 * small * small * large + 2.0 * small ** 3)


#: The rate of fp32 matmuls as a fraction of bf16's on the tensor cores, by --muon-fp32-matmul-prec, as measured
#: on an H100 (llama3-1b's 112 Newton-Schulz matrices, benchmarks/muon_one_gpu.yaml): plain fp32 on the CUDA
#: cores about a fifteenth (rows h163, h164), TF32 0.29 (h166, h167; the datasheet's TF32 is half the bf16 rate,
#: these matrices of 2,048 to 8,192 reach less of it).
FP32_MATMUL_RATE = {"highest": 1 / 15, "high": 0.29, "medium": 0.29}


def _step_work(cfg, tp: int, dp: int, pp: int, ep: int = 1) -> StepWork:
    """One rank's Newton-Schulz FLOPs and TP gathers per step: the stage's matrices (layers / PP) split over
    their owners (DP x CP ranks; experts over EP too), each orthogonalised whole on every rank of its TP group
    (duplicated: TP does not divide the work) after an all-gather of fp32 momentum of (TP - 1) / TP of it."""
    m, o = cfg.model, cfg.optim
    flops = gathered = count = 0.0
    for kinds, n in Counter(layer_kinds(m)).items():  # the layers of each kind, a stage's share of them
        layers = n / max(1, pp)
        for x in layer_matrices(m, kinds):
            owners = dp * (ep if x.expert else 1)
            flops += ns_flops(x.rows, x.cols, o.muon_num_ns_steps) * layers / owners
            if tp > 1 and o.muon_tp_mode == "duplicated":
                gathered += 4.0 * x.rows * x.cols * layers / owners
                count += layers / owners
    if tp > 1 and o.muon_tp_mode == "blockwise":
        flops /= tp
    return StepWork(matmul_flops=flops, matmul_rate=FP32_MATMUL_RATE[o.muon_fp32_matmul_prec],
                    gather_bytes=gathered, gathers=int(math.ceil(count)))


def _build(params, cfg, ctx):
    from meshtron.optim.muon_update import MixedPrecisionMuon

    return MixedPrecisionMuon(params, cfg, ctx)


def _partitions(segments, params, grad_data, param_data, cfg, ctx, host):
    from meshtron.optim.muon_update import partitions

    return partitions(segments, params, grad_data, param_data, cfg, ctx, host)


KIND = OptimizerKind(name="muon", layout=WHOLE, state_names=_states, state_bytes=_state_bytes,
                     build=_build, partitions=_partitions,
                     check=_check, step_work=_step_work,
                     description="Muon for hidden matrices, AdamW for the rest; state: master, momentum_buffer")
