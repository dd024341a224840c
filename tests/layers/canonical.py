"""For the layer tests: fill a meshtron module from full canonical tensors (its parameters' ShardSpecs say
which slices), sum TP-partial gradients, compare to 1e-5 of the largest entry."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtron.parallel.sharding import SPEC_ATTR, cut, spec_of


@torch.no_grad()
def load_canonical(module: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Materialise ``module`` (built on the meta device) on the CPU in fp32 with each parameter cut from
    ``tensors`` (canonical name -> full tensor)."""
    specs = {name: spec_of(p) for name, p in module.named_parameters()}
    module.to_empty(device="cpu")
    for name, param in module.named_parameters():
        spec = specs[name]
        param.data = torch.cat([cut(tensors[p.name].float(), p) for p in spec.pieces], dim=spec.cat_dim)
        setattr(param, SPEC_ATTR, spec)


def sum_tp_partial_grads(module: nn.Module, group) -> None:
    """Sum over TP the gradients that are partial sums there (``grad_sync="tp"``), as the gradient
    synchronisation of a training step does."""
    import torch.distributed as dist

    for p in module.parameters():
        if p.grad is not None and spec_of(p).grad_sync == "tp" and group is not None:
            dist.all_reduce(p.grad, group=group)


def close(got: torch.Tensor, ref: torch.Tensor, what: str = "") -> None:
    """Equal to 1e-5 relative, or 1e-5 of the largest entry (at least 1e-5) absolute: fp32 rounding of two
    orders of summation (gradients of the layers reach tens, and two implementations differ from a
    float64 run by a few 1e-6 of that)."""
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                               msg=lambda m: f"{what}: {m}")
