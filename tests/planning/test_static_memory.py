"""The planner's static memory of each rank equals what a real multi-process run allocates.

Each layout is built for real on gloo ranks (the run's model builder and ``build_optimization``,
process groups and all) and measured: parameter elements, gradient-buffer elements (or ZeRO-2/3's
gradient shards), the flat weight buffer, optimizer-state elements and bytes (device and host), model
buffers, buckets. The planner computes the same figures for every rank from a meta-device stage on a
planned context, in this process. They must be equal, element for element. For the sharded strategies,
real training steps on gloo ranks also measure what is allocated only while a step runs (ZeRO-3's
gathered layers, ZeRO-2/3's gradient buckets in reduction), which the planner replays from the layout.
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
# The sharded strategies (ZeRO-2 and ZeRO-3): their static figures, and what a step adds to them. Untied
# output layers (their gradient arrives first), gradient accumulation (reductions in flight across
# micro-batches), bf16 reductions, a pipeline stage without the loss, experts.
ZERO = {
    "dp4-zero2-untied-accumulation": SMALL + ["--global-batch-size", "8", "--data-parallel-sharding-strategy",
                                              "optim_grads", "--untie-embeddings-and-output-weights"],
    "dp4-zero2-bf16-reduction": SMALL + ["--global-batch-size", "4", "--data-parallel-sharding-strategy",
                                         "optim_grads", "--grad-reduce-in-bf16"],
    "dp4-zero3-tied": SMALL + ["--global-batch-size", "4", "--data-parallel-sharding-strategy", "optim_grads_params"],
    "dp4-zero3-untied-accumulation-bf16": SMALL + ["--global-batch-size", "8", "--data-parallel-sharding-strategy",
                                                   "optim_grads_params", "--untie-embeddings-and-output-weights",
                                                   "--bf16"],
    "pp2-dp2-zero3": SMALL + ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4",
                              "--data-parallel-sharding-strategy", "optim_grads_params"],
    "moe-ep2-dp4-zero3": SMALL + ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size",
                                  "2", "--global-batch-size", "4", "--data-parallel-sharding-strategy",
                                  "optim_grads_params"],
}


def _config(argv: list[str], world: int):
    cfg = build_config(argv)
    validate_config(cfg, world)
    return cfg


def _allocated(rank: int, world: int, layouts: dict) -> dict:
    """On one gloo rank: build each layout for real and measure what it allocated."""
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
        out[name] = _allocation_row(chunks, optim)
        optim.close()
    return out


def _allocation_row(chunks, optim) -> dict:
    """What one rank's model chunks and optimization have allocated (the planner's static figures)."""
    from meshtron.optim.distributed_optimizer import DistributedOptimizer

    optimizer = optim.optimizer
    optimizer.ensure_state()  # the moments exist from the first step on; create them now
    params = [q for chunk in chunks for q in chunk.parameters()]
    strategy = optim.strategy
    # As allocated during backward: the full buffer (one tensor, or one per bucket), or ZeRO-2/3's shards.
    grads = strategy.grad_buffer.tensors() if strategy.grad_buffer is not None else [strategy.grad_data]
    row = {"parameters": sum(q.numel() for q in params),
           "grad_buffer_numel": sum(t.numel() for t in grads),
           "gradients": sum(t.numel() * t.element_size() for t in grads),
           "model_buffers": sum(b.numel() * b.element_size() for chunk in chunks for b in chunk.buffers()),
           "buckets": len(optim.layout.buckets)}
    if isinstance(optimizer, DistributedOptimizer):
        flat = strategy.param_buffer.data if strategy.param_buffer is not None else None  # none with ZeRO-3
        row.update(param_buffer_numel=None if flat is None else flat.numel(),
                   weights=strategy.allocated().weights,
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
    return row


def _measure_step_transients(trainer, steps: int = 2) -> dict:
    """Run ``steps`` training steps, sampling the bytes of the sharded strategy's temporary tensors each time
    one is allocated: ZeRO-3's gathered weight buckets; ZeRO-2/3's full gradient buckets being filled or
    reduced, with the reduce-scatters' outputs and the inputs their collectives hold until waited for."""
    import meshtron.optim.sharded_grads as sharded_grads

    strategy = trainer.dp_strategy
    grads, weights = strategy.grads, getattr(strategy, "sharded_params", None)
    peak = {"gathered_weights": 0, "reduction_buckets": 0}
    held: dict[int, torch.Tensor] = {}  # id(reduce-scatter output) -> the full bucket it reads

    def nbytes(t: torch.Tensor) -> int:
        return t.untyped_storage().nbytes()

    def sample_reduction(*extra: torch.Tensor) -> None:
        live = sum(nbytes(t) for t in grads._full if t is not None) + sum(nbytes(t) for t in extra)
        live += sum(nbytes(out) + (nbytes(held[id(out)]) if id(out) in held else 0)
                    for _, _, out in grads._in_flight)
        peak["reduction_buckets"] = max(peak["reduction_buckets"], live)

    original_scatter, original_reduce = sharded_grads.reduce_scatter_single, grads._reduce

    def scatter(out, full, group, async_op=False):  # the output shard has just been allocated
        sample_reduction(full, out)
        held[id(out)] = full
        return original_scatter(out, full, group, async_op=async_op)

    def reduce(b: int) -> None:  # every open bucket, the completed one included
        sample_reduction()
        original_reduce(b)

    sharded_grads.reduce_scatter_single, grads._reduce = scatter, reduce
    if weights is not None:
        original_gather = weights._start_gather

        def start_gather(b: int) -> None:  # allocates the bucket's full storage
            original_gather(b)
            peak["gathered_weights"] = max(peak["gathered_weights"], sum(nbytes(f) for f in weights.full))

        weights._start_gather = start_gather
    try:
        batches = next(trainer.data.train_batches())
        for iteration in range(1, steps + 1):
            trainer.train_step(batches, iteration)
    finally:
        sharded_grads.reduce_scatter_single = original_scatter
    return peak


def _step_transients(rank: int, world: int, layouts: dict) -> dict:
    """On one gloo rank: build each sharded layout through the trainer, measure its static allocations, train
    two steps and measure its step transients."""
    from meshtron.bench import RandomTokens
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer

    out = {}
    for name, argv in layouts.items():
        cfg = _config(argv, world)
        ctx = context_from_config(cfg)
        t = cfg.train
        data = RandomTokens(VOCAB, cfg.model.seq_length, t.micro_batch_size,
                            t.global_batch_size // (t.micro_batch_size * ctx.dp), t.seed)
        trainer = Trainer(cfg, ctx, data=data)
        try:
            static = _allocation_row(trainer.model_chunks, trainer.optim)
            out[name] = (static, _measure_step_transients(trainer))
        finally:
            trainer.close()
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


def test_zero2_and_zero3_plans_are_what_real_steps_allocate():
    measured = run_distributed(_step_transients, WORLD, ZERO, timeout=400)
    for rank, per_layout in enumerate(measured):
        for name, argv in ZERO.items():
            static, transients = per_layout[name]
            assert _planned(argv, WORLD, rank) == static, f"{name}, rank {rank}"
            m = rank_memory(_config(argv, WORLD), VOCAB, WORLD, rank)
            planned = {"gathered_weights": m.gathered_weights, "reduction_buckets": m.reduction_buckets}
            assert planned == transients, f"{name}, rank {rank}"
    zero3 = rank_memory(_config(ZERO["dp4-zero3-tied"], WORLD), VOCAB, WORLD, 0)
    assert zero3.gathered_weights > 0 and zero3.reduction_buckets > 0  # the comparison is not of zeros


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


@pytest.mark.parametrize("strategy, name", [("no_shard", "no_shard (replicated)"), ("optim", "optim (ZeRO-1)"),
                                            ("optim_grads", "optim_grads (ZeRO-2)"),
                                            ("optim_grads_params", "optim_grads_params (ZeRO-3)")])
def test_meshtron_plan_dry_run_reports_every_strategy(capsys, strategy, name):
    argv = ["plan", "--dry-run", "--world-size", "4", "--ranks", "0"] + SMALL + [
        "--global-batch-size", "4", "--data-parallel-sharding-strategy", strategy]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].endswith(f", {name}, fp32"), text
    assert "(-" not in text  # no negative padding
    assert main(argv + ["--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["strategy"] == strategy and row["padding_numel"] == row["layout_numel"] - row["parameters"] >= 0
    sharded = strategy in ("optim_grads", "optim_grads_params")
    assert (row["weight_shard_numel"] is not None) == sharded
    assert (row["param_buffer_numel"] is None) == (strategy in ("no_shard", "optim_grads_params"))
    assert (row["gathered_weights"] > 0) == (strategy == "optim_grads_params")
    assert (row["reduction_buckets"] > 0) == sharded
    # The peak counts every part at its largest: what a sharded strategy allocates during a step too.
    assert row["estimated_peak"] == (row["device_total"] - row["gradients"] + row["gradients_at_peak"]
                                     + row["pipeline_message"] + row["step_transients"] + row["activations"]
                                     + row["logits"])
    if strategy == "optim_grads_params":  # the weights line holds the shard, not the whole layout
        weights = next(line for line in text.splitlines() if line.strip().startswith("weights"))
        assert f"this rank's shard: {row['weight_shard_numel']:,} of {row['layout_numel']:,}" in weights
        assert "gathered layers" in text
