"""The planner's static memory of each rank equals what a real multi-process run allocates.

Each layout is built for real on gloo ranks (the run's model builder and ``build_optimization``,
process groups and all) and measured: parameter elements, gradient-buffer elements, the flat weight
buffer, optimizer-state elements and bytes (device and host), model buffers, buckets. The planner
computes the same figures for every rank from a meta-device stage on a planned context, in this
process. They must be equal, element for element.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from meshtron.cli import build_config, main
from meshtron.planning.fake_context import planned_context
from meshtron.planning.static_memory import rank_memory
from meshtron.validation import validate_config
from tests.distributed.launch import run_distributed

VOCAB = 1000
# Shapes that are not multiples of the 64-element shard alignment, and small buckets, so that the
# padding and the shard boundaries (segments cut inside parameters) are exercised.
SMALL = ["--device", "cpu", "--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4",
         "--ffn-hidden-size", "100", "--seq-length", "16", "--vocab-size", str(VOCAB), "--ddp-bucket-size", "3000",
         "--micro-batch-size", "1"]

# Four gloo ranks (one spawn keeps the test short): DP=4, TP=2 x DP=2, EP=2 over DP=4 (expert-DP groups of
# two), PP=2 x DP=2.
LAYOUTS = {
    "dp4": SMALL + ["--global-batch-size", "4"],
    "dp4-distopt-bf16-offload": SMALL + ["--global-batch-size", "4", "--use-distributed-optimizer", "--bf16",
                                         "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.3"],
    "dp4-distopt-fp32-bf16-grads": SMALL + ["--global-batch-size", "4", "--use-distributed-optimizer",
                                            "--grad-reduce-in-bf16"],
    "tp2-sp-replicated-kv-dp2": SMALL + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                         "--group-query-attention", "--num-query-groups", "1",
                                         "--untie-embeddings-and-output-weights", "--global-batch-size", "2"],
    "moe-ep2-dp4-distopt": SMALL + ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size",
                                    "2", "--moe-router-enable-expert-bias", "--use-distributed-optimizer",
                                    "--global-batch-size", "4"],
    "pp2-dp2-distopt-tied": SMALL + ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                     "--global-batch-size", "4"],
    "pp2-interleaved-dp2": SMALL + ["--pipeline-model-parallel-size", "2",
                                    "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4",
                                    "--bf16"],
}
WORLD = 4


def _config(argv: list[str], world: int):
    cfg = build_config(argv)
    validate_config(cfg, world)
    return cfg


def _allocated(rank: int, world: int, layouts: dict) -> dict:
    """On one gloo rank: build each layout for real and measure what it allocated."""
    from meshtron.optim.distributed_optimizer import DistributedOptimizer
    from meshtron.optim.factory import build_optimization
    from meshtron.parallel.context import build_groups
    from meshtron.parallel.random import RNGTracker
    from meshtron.build import build_model_chunks

    out = {}
    for name, argv in layouts.items():
        cfg = _config(argv, world)
        p = cfg.parallel
        ctx = build_groups(p.tensor_model_parallel_size, p.context_parallel_size, p.pipeline_model_parallel_size,
                           p.expert_model_parallel_size, torch.device("cpu"))
        dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
        tracker = RNGTracker(cfg.train.seed, ctx.tp_rank, ctx.pp_rank, ctx.device)
        chunks = build_model_chunks(cfg, ctx, VOCAB, tracker, dtype)
        optim = build_optimization(cfg, ctx, chunks)
        optimizer = optim.optimizer
        optimizer.ensure_state()  # the moments exist from the first step on; create them now
        params = [q for chunk in chunks for q in chunk.parameters()]
        grads = optim.grad_buffer.tensors()  # as allocated during backward (one tensor, or one per bucket)
        row = {"parameters": sum(q.numel() for q in params),
               "grad_buffer_numel": sum(t.numel() for t in grads),
               "gradients": sum(t.numel() * t.element_size() for t in grads),
               "model_buffers": sum(b.numel() * b.element_size() for chunk in chunks for b in chunk.buffers()),
               "buckets": len(optim.layout.buckets)}
        if isinstance(optimizer, DistributedOptimizer):
            flat = optimizer.param_buffer.data
            row.update(param_buffer_numel=flat.numel(), weights=flat.numel() * flat.element_size(),
                       state_numel=optimizer.state_numel(), **{f"state_{k}": v
                                                              for k, v in optimizer.state_bytes().items()})
        else:
            state = [optimizer.inner.state[m] for m in optimizer.masters]
            copies = [m for q, m in zip(optimizer.params, optimizer.masters) if m is not q]
            row.update(param_buffer_numel=None, weights=sum(q.numel() * q.element_size() for q in params),
                       state_numel={"master": sum(m.numel() for m in optimizer.masters),
                                    "exp_avg": sum(s["exp_avg"].numel() for s in state),
                                    "exp_avg_sq": sum(s["exp_avg_sq"].numel() for s in state)},
                       state_device=sum(m.numel() * 4 for m in copies)
                       + sum(s[k].numel() * s[k].element_size() for s in state for k in ("exp_avg", "exp_avg_sq")),
                       state_host=0)
        out[name] = row
        optim.close()
    return out


def _planned(argv: list[str], world: int, rank: int) -> dict:
    m = rank_memory(_config(argv, world), VOCAB, world, rank)
    return {"parameters": m.parameters, "grad_buffer_numel": m.grad_buffer_numel, "gradients": m.gradients,
            "model_buffers": m.model_buffers, "buckets": m.buckets, "param_buffer_numel": m.param_buffer_numel,
            "weights": m.weights, "state_numel": m.optimizer.numel, "state_device": m.optimizer.device_bytes,
            "state_host": m.optimizer.host_bytes}


def _check(layouts: dict, world: int) -> None:
    measured = run_distributed(_allocated, world, layouts)
    for rank, per_layout in enumerate(measured):
        for name, argv in layouts.items():
            assert _planned(argv, world, rank) == per_layout[name], f"{name}, rank {rank}"


def test_planned_ranks_allocate_what_real_ranks_allocate():
    _check(LAYOUTS, WORLD)


def test_the_layouts_exercise_padding_offload_and_experts():
    """The cases above are not trivial: shard padding, a host part, expert parameters, model buffers."""
    offload = rank_memory(_config(LAYOUTS["dp4-distopt-bf16-offload"], WORLD), VOCAB, WORLD, 3)
    assert offload.padding_numel > 0 and offload.optimizer.host_bytes > 0 and offload.optimizer.device_bytes > 0
    moe = rank_memory(_config(LAYOUTS["moe-ep2-dp4-distopt"], WORLD), VOCAB, WORLD, 0)
    assert 0 < moe.expert_parameters < moe.parameters and moe.model_buffers > 0
    first, last = (rank_memory(_config(LAYOUTS["pp2-dp2-distopt-tied"], WORLD), VOCAB, WORLD, r) for r in (0, 2))
    assert first.pipeline_message == 16 * 1 * 48 * 4 and first.parameters != last.parameters


def test_planned_context_coordinates_follow_the_rank_order():
    """rank = tp + TP*(cp + CP*(dp + DP*pp)); EP splits DP x CP with ep fastest."""
    ctx = planned_context(32, 29, tp=2, cp=2, pp=2, ep=2)  # DP=4
    assert (ctx.tp_rank, ctx.cp_rank, ctx.dp_rank, ctx.pp_rank) == (1, 0, 3, 1)
    assert ctx.tp_group.members == (28, 29) and ctx.tp_group.rank() == 1
    assert ctx.dp_group.members == (17, 21, 25, 29) and ctx.pp_group.members == (13, 29)
    assert ctx.dp_cp_group.size() == 8 and ctx.dp_cp_group.rank() == 6
    assert (ctx.ep_rank, ctx.expert_dp_rank) == (0, 3)
    assert ctx.ep_group.members == (29, 31) and ctx.expert_dp_group.members == (17, 21, 25, 29)
    assert ctx.embedding_group.members == (13, 29)


def test_llama3_405b_plans_in_seconds():
    argv = ["--model", "llama3-405b", "--device", "cpu", "--bf16", "--tensor-model-parallel-size", "8",
            "--pipeline-model-parallel-size", "7", "--context-parallel-size", "2", "--sequence-parallel",
            "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "64"]
    cfg = _config(argv, 896)
    start = time.monotonic()
    last = rank_memory(cfg, 128256, 896, 895)
    assert time.monotonic() - start < 30
    # 18 layers of 1/8 of llama3-405b plus the final norm and output layer shard; the state is 1/16 of it.
    assert last.parameters == 7_437_107_200
    assert last.optimizer.master_numel == last.grad_buffer_numel // 16


def test_meshtron_plan_dry_run_prints_the_chosen_ranks(capsys):
    argv = ["plan", "--dry-run", "--world-size", "4", "--ranks", "0,last", "--json"] + LAYOUTS["pp2-dp2-distopt-tied"]
    assert main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["rank"] for r in rows] == [0, 3]
    assert rows[0]["parameters"] == _planned(LAYOUTS["pp2-dp2-distopt-tied"], 4, 0)["parameters"]
    assert rows[1]["estimated_peak"] > rows[1]["device_total"] > 0


def test_train_dry_run_prints_the_plan_and_creates_no_process_group(capsys):
    argv = ["train", "--dry-run", "--nproc-per-node", "4"] + LAYOUTS["pp2-dp2-distopt-tied"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "on 4 ranks" in out and "rank 0 (" in out and "rank 3 (" in out
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("argv, flag", [
    (["--world-size", "3", "--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size"),
    (["--world-size", "2", "--ranks", "0,2"], "--ranks"),
    (["--world-size", "2", "--ranks", "zero"], "--ranks"),
])
def test_meshtron_plan_names_a_bad_flag(capsys, argv, flag):
    assert main(["plan", "--device", "cpu"] + SMALL[2:] + ["--global-batch-size", "2"] + argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], lines
