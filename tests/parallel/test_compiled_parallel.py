"""torch.compile'd layers in parallel layouts: tensor + sequence parallel (backward overlap on and off, query/key
head norms) and mixture of experts with expert or tensor parallelism (also padded to capacity) give the
one-process losses and gradients.
Communication inside compiled layers is where gradients can silently go missing (see
docs/parallelism-tensor.md). This file runs the cases on CPU (gloo; those in SLOW are marked slow);
tests/parallel/test_tp_gpu.py runs them all on two GPUs (NCCL)."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from meshtron.parallel.context import ParallelContext
from tests.distributed.launch import run_distributed
from tests.pipeline.pipeline_helpers import layout_worker, model_config, run_config, train_and_collect


def _moe_model():
    return dataclasses.replace(model_config(tied=False), num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                               moe_aux_loss_coeff=0.01)


#: name -> (model, layout keywords of run_config, compiled layers)
CASES = {
    "tp2-sp-eager": (model_config(tied=False), dict(tp=2, sp=True), False),
    "tp2-sp-overlap": (model_config(tied=False), dict(tp=2, sp=True, tp_comm_overlap=True), True),
    "tp2-sp-no-overlap": (model_config(tied=False), dict(tp=2, sp=True, tp_comm_overlap=False), True),
    "moe-ep2": (_moe_model(), dict(expert_model_parallel_size=2), True),
    "moe-tp2-sp": (_moe_model(), dict(tp=2, sp=True), True),
    "qk-norm-tp2-sp": (dataclasses.replace(model_config(tied=False), qk_layernorm=True), dict(tp=2, sp=True), True),
    "moe-ep2-capacity-padded": (dataclasses.replace(_moe_model(), moe_expert_capacity_factor=1.0,
                                                    moe_pad_expert_input_to_capacity=True),
                                dict(expert_model_parallel_size=2), True),
}


def compiled_layout_failures(device: str, backend: str, rtol: float, atol: float,
                             cases_by_name: dict = CASES) -> list[str]:
    """Run every case on two ranks and return what differs from the one-process run on ``device``."""
    cases = [run_config(model, global_batch=4, device=device, compile=compiled, **kw)
             for model, kw, compiled in cases_by_name.values()]
    results = run_distributed(layout_worker, 2, cases, device, backend=backend, timeout=900)
    ref_ctx = ParallelContext(device=torch.device(device, 0) if device == "cuda" else torch.device("cpu"))
    refs: dict = {}
    failures = []
    for i, (name, (model, _, _)) in enumerate(cases_by_name.items()):
        if repr(model) not in refs:  # one reference per distinct model
            refs[repr(model)] = train_and_collect(run_config(model, global_batch=4, device=device), ref_ctx)
        ref = refs[repr(model)]
        for rank, per_case in enumerate(results):
            out = per_case[i]
            if not torch.allclose(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=rtol, atol=atol):
                failures.append(f"{name} rank {rank}: losses {out['losses']} != {ref['losses']}")
            for key in ref["grads"]:
                got, want = out["grads"][key], ref["grads"][key]
                if not torch.allclose(got, want, rtol=10 * rtol, atol=atol):
                    failures.append(f"{name} rank {rank}: grad {key} off by {(got - want).abs().max():.3g} "
                                    f"(norm {got.norm():.4g} vs {want.norm():.4g})")
    return failures


#: Compiled variants whose layout keeps a compiled case in the default run (tp2-sp-overlap: TP + SP with the
#: default overlap; moe-ep2: compiled experts) and an eager one elsewhere (tests/parallel/test_tensor_parallel.py,
#: the MoE suites): run with ``-m slow``. The GPU test runs every case.
SLOW = ("tp2-sp-no-overlap", "moe-tp2-sp", "qk-norm-tp2-sp")
needs_cxx = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                               reason="torch.compile on CPU needs a C++ compiler")


@needs_cxx
def test_compiled_layers_in_parallel_layouts_match_one_process():
    failures = compiled_layout_failures("cpu", "gloo", rtol=1e-5, atol=1e-6,
                                        cases_by_name={k: v for k, v in CASES.items() if k not in SLOW})
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@needs_cxx
def test_more_compiled_layers_in_parallel_layouts_match_one_process():
    failures = compiled_layout_failures("cpu", "gloo", rtol=1e-5, atol=1e-6,
                                        cases_by_name={k: v for k, v in CASES.items() if k in SLOW})
    assert not failures, "\n".join(failures)
