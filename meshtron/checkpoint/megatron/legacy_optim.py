"""The optimizer state of Megatron-LM's legacy format, per model-parallel rank ``mp_rank_TT[_PPP][_EEE]/``:

* with the distributed optimizer, ``distrib_optim.pt`` (``DistributedOptimizer.save_parameter_state``): per
  parameter buffer (one per model chunk with virtual pipeline stages) ``{(param dtype, grad dtype): {"param",
  "exp_avg", "exp_avg_sq": the buckets' unpadded contents one after another, "numel_unpadded"}}`` beside
  ``"buckets_coalesced": True``; its buckets are laid
  out as :mod:`.buckets` describes. A mixture-of-experts model's two chained optimizers (dense parameters over
  the data-parallel group, experts over the expert-data-parallel group) save the list of both
  (``ChainedOptimizer.save_parameter_state``), each entry gathered on rank 0 of its own group and None on the
  other ranks; every rank that is rank 0 of either group writes its directory's file, so the dense buffer of
  (tp, pp) is in one of its expert-parallel directories and the experts' buffer of expert rank (tp, ep, pp) in
  ``mp_rank_TT[_PPP]_EEE`` (:func:`_gather_chains`); at expert-parallel 1 its experts are in the dense buffer
  and its one optimizer's state is saved as a dense model's;
* without it, ``model_optim_rng.pt``'s ``optimizer`` entry: torch's optimizer ``state_dict()`` (``state`` by
  parameter index, ``param_groups`` with the indices of each group), under ``optimizer`` beside
  ``fp32_from_fp16_params`` (the fp32 masters, group by group) for a bf16/fp16 model
  (``Float16OptimizerWithFloat16Params``), or as it is for an fp32 model (``FP32Optimizer``, whose parameters are
  the masters). Megatron-LM's parameter groups are the parameters with weight decay (matrices) and those
  without (``wd_mult`` 0: one-dimensional and biases), each in ``named_parameters()`` order. A
  mixture-of-experts model's entry is the list of its two chained optimizers' (``ChainedOptimizer.state_dict``:
  the dense parameters', replicated on every expert-parallel rank, then the rank's experts', without the group of
  a decay kind they have no parameter of), in every directory ``mp_rank_TT[_PPP]_EEE``; at expert-parallel 1
  one optimizer, the experts in its groups among their layer's parameters.

Every layout is checked against the model's weights (the masters must equal them, rounded to the model's dtype)
before anything is taken from it; :class:`~.buckets.LayoutMismatch` says where it did not fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron import buckets
from meshtron.checkpoint.megatron.buckets import LayoutMismatch
from meshtron.checkpoint.megatron.detect import DISTRIB_OPTIM_FILE
from meshtron.checkpoint.megatron.unpickler import load_pickled

_STATES = ("param", "exp_avg", "exp_avg_sq")


def _optimizer_chain(state: Any, count: int, what: str) -> list:
    """The ``count`` chained optimizers' states in ``state`` (``distrib_optim.pt``, or a ``model_optim_rng.pt``
    ``optimizer`` entry, named ``what``): a ChainedOptimizer of several saves their list, one optimizer itself."""
    chain = state if isinstance(state, list) else [state]
    if len(chain) != count:
        raise LayoutMismatch(f"{what} holds {len(chain)} optimizers, expected "
                             f"{'2 (chained: dense parameters, experts)' if count == 2 else 'one'}")
    return chain


def _check_expert_tp(experts_of: dict, tp_size: int, etp_size: Optional[int]) -> None:
    """The legacy files name no expert tensor-parallel rank: only expert TP equal to TP can be placed."""
    if experts_of and (etp_size or tp_size) != tp_size:
        raise LayoutMismatch(f"expert tensor parallelism {etp_size} unlike tensor parallelism {tp_size}: the legacy "
                             "files' names do not say which expert tensor-parallel rank wrote them")


def _read_chain(f: Path, count: int, vp_size: int) -> list[Optional[dict[int, dict[str, torch.Tensor]]]]:
    """Each of the ``count`` chained optimizers' {model chunk: {state: flat buffer}} in ``distrib_optim.pt`` ``f``
    (None where the file's writer was not rank 0 of that optimizer's data-parallel group): one optimizer's state as
    it is, a ChainedOptimizer's of several as their list."""
    chain = _optimizer_chain(load_pickled(f, str(f)), count, str(f))
    return [None if entry is None else _coalesced(entry, f, vp_size) for entry in chain]


def _coalesced(state: Any, f: Path, vp_size: int) -> dict[int, dict[str, torch.Tensor]]:
    """{model chunk: {state: flat buffer}} of one optimizer's ``get_parameter_state_dp_zero()``: one buffer (its
    ``gbuf_idx``) per model chunk, each of one parameter dtype."""
    if not isinstance(state, dict) or not state.get("buckets_coalesced"):
        raise LayoutMismatch(f"{f} is not the coalesced per-buffer state of megatron-core's "
                             "DistributedOptimizer.save_parameter_state (an older layout)")
    buffers = [k for k in state if k != "buckets_coalesced"]
    if buffers != list(range(vp_size)) or any(not isinstance(state[k], dict) or len(state[k]) != 1 for k in buffers):
        raise LayoutMismatch(f"{f} holds buffers {buffers}, expected one per model chunk ({vp_size}) of one "
                             "parameter dtype each")
    out = {}
    for chunk in buffers:
        inner = next(iter(state[chunk].values()))
        missing = [k for k in _STATES if not isinstance(inner.get(k), torch.Tensor)]
        if missing:
            raise CheckpointError(f"Megatron-LM checkpoint file {f} is not a distributed optimizer's state: no "
                                  f"{', '.join(missing)} tensor")
        out[chunk] = {k: inner[k].float() for k in _STATES}
    return out


def _gather_chains(files: dict[tuple[int, int, int], Path], tp_size: int, ep_size: int, moe: bool, vp_size: int = 1
                   ) -> tuple[dict[tuple[int, int], dict[str, torch.Tensor]],
                              dict[tuple[int, int], dict[str, torch.Tensor]]]:
    """({(model-parallel rank, model chunk): dense buffer}, {(expert rank, model chunk): experts' buffer}) from every
    ``distrib_optim.pt`` (``moe``: the experts in a buffer of their own, a second chained optimizer).

    Each file is written by the ranks of its directory (tp, pp, ep) that are rank 0 of the dense optimizer's
    data-parallel group or of the experts' expert-data-parallel group: the dense buffer of (tp, pp) is in exactly
    one of its expert-parallel directories, the experts' buffer of expert rank (tp, ep, pp) in directory (tp, pp,
    ep) (expert tensor parallelism equal to tensor parallelism)."""
    dense: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    experts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for (tp, pp, ep), f in sorted(files.items()):
        path = f.parent / DISTRIB_OPTIM_FILE
        chain = _read_chain(path, 2 if moe else 1, vp_size)
        index = tp + tp_size * pp
        if chain[0] is not None:
            if (index, 0) in dense:
                raise LayoutMismatch(f"{path}: a second dense buffer of model-parallel rank {index}")
            dense.update({(index, v): b for v, b in chain[0].items()})
        if moe:
            if chain[1] is None:
                raise LayoutMismatch(f"{path} holds no experts' buffer (its writer not expert-data-parallel rank 0)")
            experts.update({(tp + tp_size * (ep + ep_size * pp), v): b for v, b in chain[1].items()})
        elif ep:
            raise LayoutMismatch(f"{path}: an expert-parallel rank for a model without experts")
    return dense, experts


def distributed_state(files: dict[tuple[int, int, int], Path], model: dict[str, torch.Tensor], tp_size: int,
                      pp_size: int, num_layers: int, spec: str, swiglu: bool, tied: bool,
                      bucket_size: Optional[int], ep_size: int = 1, etp_size: Optional[int] = None,
                      grouped: bool = False, vp_size: int = 1, uneven: buckets.Uneven = buckets.EVEN
                      ) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {Megatron name: whole tensor}} from every rank's ``distrib_optim.pt`` (one buffer per model chunk:
    ``vp_size`` virtual pipeline stages); a mixture-of-experts model's experts from the second of its chained
    optimizers (expert parallelism ``ep_size``, expert tensor parallelism ``etp_size`` (None: ``tp_size``),
    ``grouped``: TEGroupedMLP's order) unless at expert-parallel 1 they are in the dense buffer."""
    buckets.check_split(num_layers, pp_size, vp_size, uneven)
    experts_of = buckets.experts_by_layer(model)
    _check_expert_tp(experts_of, tp_size, etp_size)
    apart = bool(experts_of) and buckets.experts_apart(tp_size, ep_size, etp_size)
    dense, experts = _gather_chains(files, tp_size, ep_size, apart, vp_size)
    ranks = buckets.dense_ranks(model, tp_size, pp_size, num_layers, spec, swiglu, tied,
                                bool(experts_of) and not apart, grouped, vp_size, uneven)
    flat = buckets.split_coalesced(ranks, dense, bucket_size)
    expert_flat = None
    if apart:
        eranks = buckets.expert_ranks(experts_of, tp_size, ep_size, pp_size, num_layers, swiglu, grouped, vp_size,
                                      uneven)
        expert_flat = buckets.split_coalesced(eranks, experts, bucket_size)
    return buckets.unflatten(model, flat, tp_size, pp_size, num_layers, spec, swiglu, tied, bucket_size,
                             expert_flat, ep_size, tp_size, grouped, vp_size, uneven)


def _no_decay(name: str, t: torch.Tensor) -> bool:
    """Megatron-LM's standard parameter groups: no weight decay on one-dimensional parameters and biases."""
    return t.dim() == 1 or name.endswith(".bias")


def _group_members(groups: list, rank: buckets.Rank, where: str) -> list[tuple[int, int, Any, str, torch.Tensor]]:
    """(group, place in it, parameter index, Megatron name, shard) of every parameter of ``rank``, Megatron-LM's
    standard groups each holding those with weight decay or those without (``wd_mult`` 0), in
    ``named_parameters()`` order; a group of either kind may be left out or empty where the rank has none
    (the experts' optimizer: matrices only)."""
    by_decay: dict[bool, list] = {True: [], False: []}
    for name, t in rank.params:
        by_decay[_no_decay(name, t)].append((name, t))
    kinds = [float(group.get("wd_mult", 1.0)) == 0.0 for group in groups]
    sizes = [len(group.get("params", ())) for group in groups]
    if len(set(kinds)) != len(kinds) or any(len(by_decay[k]) != n for k, n in zip(kinds, sizes)) or \
            any(members and k not in kinds for k, members in by_decay.items()):
        raise LayoutMismatch(f"{where}: parameter groups of {sizes} parameters, Megatron-LM's standard groups here "
                             f"would hold {[len(by_decay[False]), len(by_decay[True])]}")
    return [(g, k, groups[g]["params"][k], name, t) for g, kind in enumerate(kinds)
            for k, (name, t) in enumerate(by_decay[kind])]


def _rank_state(opt: Any, rank: buckets.Rank, where: str) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {Megatron name: this rank's shard}} of one rank's non-distributed optimizer ``state_dict()``."""
    masters = None
    if isinstance(opt, dict) and "fp32_from_fp16_params" in opt:
        masters, opt = opt["fp32_from_fp16_params"], opt.get("optimizer")
    if not isinstance(opt, dict) or not isinstance(opt.get("state"), dict) or \
            not isinstance(opt.get("param_groups"), list):
        raise CheckpointError(f"{where}: its 'optimizer' entry is not an optimizer's state_dict (state, "
                              "param_groups)")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for g, k, index, name, t in _group_members(opt["param_groups"], rank, where):
        state = opt["state"].get(index) or {}
        master = masters[g][k] if masters is not None else t
        for key, value in (("param", master), ("exp_avg", state.get("exp_avg")),
                           ("exp_avg_sq", state.get("exp_avg_sq"))):
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(t.shape):
                raise LayoutMismatch(f"{where}: the optimizer's {key} of parameter {index} is not shaped like {name} "
                                     f"{tuple(t.shape)}")
            out.setdefault(key, {})[name] = value.float()
        if not torch.equal(out["param"][name].to(t.dtype), t):
            raise LayoutMismatch(f"{where}: the master weight of parameter {index} is not {name}")
    return out


def _chunks_joined(ranks: list[buckets.Rank]) -> buckets.Rank:
    """One rank's model chunks as its non-distributed optimizer holds them: Megatron-LM's parameter groups take
    every parameter of chunk 0, then of chunk 1, and so on."""
    first = ranks[0]
    return buckets.Rank(first.tp, first.pp, [p for r in ranks for p in r.params], first.first_stage,
                        set().union(*(r.shared_embedding for r in ranks)))


def _file_ranks(key: tuple[int, int, int], opt: Any, model: dict[str, torch.Tensor], experts_of: dict, tp_size: int,
                pp_size: int, ep_size: int, num_layers: int, spec: str, swiglu: bool, tied: bool, grouped: bool,
                uneven: buckets.Uneven = buckets.EVEN, vp_size: int = 1) -> list[tuple[Any, buckets.Rank, str]]:
    """(optimizer state_dict, the parameters it holds, label) of file (tp, pp, ep): its dense optimizer's (taken
    from expert-parallel rank 0, the others hold replicas of it) and, with experts, its experts' optimizer's
    (expert tensor parallelism equal to tensor parallelism); with virtual stages over all the rank's chunks."""
    tp, pp, ep = key
    # else the experts are the dense optimizer's, among their layer's (expert TP equals TP here)
    apart = bool(experts_of) and buckets.experts_apart(tp_size, ep_size, tp_size)
    where = f"mp_rank_{tp:02d}_{pp:03d}" + (f"_{ep:03d}" if apart else "")
    if ep >= ep_size:
        raise LayoutMismatch(f"{where}: expert-parallel rank {ep} of {ep_size}")
    chain = _optimizer_chain(opt, 2 if apart else 1, f"{where}: its 'optimizer' entry")
    out = []
    if ep == 0:
        out.append((chain[0], _chunks_joined([
            buckets.rank_params(model, tp, pp, tp_size, pp_size, num_layers, spec, swiglu, tied,
                                bool(experts_of) and not apart, grouped, v, vp_size, uneven)
            for v in range(vp_size)]), where))
    if apart:
        out.append((chain[1], _chunks_joined([
            buckets.expert_rank_params(experts_of, tp, ep, pp, tp_size, ep_size, pp_size, num_layers, swiglu,
                                       grouped, v, vp_size, uneven)
            for v in range(vp_size)]), f"{where} (experts)"))
    return out


def local_state(states: dict[tuple[int, int, int], dict], model: dict[str, torch.Tensor], tp_size: int,
                pp_size: int, num_layers: int, spec: str, swiglu: bool, tied: bool, ep_size: int = 1,
                etp_size: Optional[int] = None, grouped: bool = False, uneven: buckets.Uneven = buckets.EVEN,
                vp_size: int = 1) -> dict[str, dict[str, torch.Tensor]]:
    """{state: {Megatron name: whole tensor}} from every rank's ``model_optim_rng.pt`` ``optimizer`` entry; a
    mixture-of-experts model's experts from the second of its chained optimizers, per expert-parallel rank
    (``ep_size``; ``etp_size`` None or ``tp_size``; ``grouped``: TEGroupedMLP's order; ``uneven``: the first and
    last stages' own layer counts; ``vp_size`` model chunks per rank, in one optimizer)."""
    buckets.check_split(num_layers, pp_size, vp_size, uneven)
    experts_of = buckets.experts_by_layer(model)
    _check_expert_tp(experts_of, tp_size, etp_size)
    shards: dict[str, dict[str, list]] = {}
    for key, state in sorted(states.items()):
        for opt, rank, where in _file_ranks(key, state.get("optimizer"), model, experts_of, tp_size, pp_size,
                                            ep_size, num_layers, spec, swiglu, tied, grouped, uneven, vp_size):
            for which, by_name in _rank_state(opt, rank, where).items():
                for name, t in by_name.items():
                    shards.setdefault(which, {}).setdefault(name, [None] * tp_size)[key[0]] = t
    out: dict[str, dict[str, torch.Tensor]] = {}
    for which, by_name in shards.items():
        for name, parts in by_name.items():
            if (tied and name == "output_layer.weight") or name == buckets.EMBEDDING_COPY:
                continue  # a copy of the embedding: the first stage's own state is the one kept
            out.setdefault(which, {})[name] = buckets.merge_shards(name, parts, swiglu).clone()
    return out
