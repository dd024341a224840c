"""Through the trainer: every --data-parallel-sharding-strategy trains the one-process model.

Four gloo processes run a tiny model (fp32, weight decay, gradient clipping below the
first steps' norms) under each strategy and layout, log the losses and gradient norms of
one process to 1e-5, and save a final checkpoint whose layout-free tensors (weights, fp32
masters and Adam moments) equal the one-process run's. A ZeRO-3 checkpoint of TP=2 x DP=2 resumes
under PP=2 x DP=2 with the distributed optimizer, and a TP=2 one under ZeRO-3 (DP=4), each continuing the
one-process run. Each
rank also checks that the weights, gradients and optimizer state it allocated equal what
the static memory model predicts for it. ZeRO-3 also runs with compiled layers (gathered
outside the compiled region: no graph break, nothing compiled after the first step), with
CPU optimizer offload, and with FP8 linears (bf16, against the one-process FP8 run). One
launch serves every case.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from meshtron.config import MeshtronConfig
from tests.distributed.launch import run_distributed

ITERS = 4
WORLD = 4
HAVE_CXX = shutil.which("g++") is not None or shutil.which("c++") is not None
#: FP8 linears (their matmuls through torch._scaled_mm, which runs on the CPU too) need bf16.
FP8 = dict(fp8_format="hybrid", bf16=True)


def _config(save=None, load=None, iters=ITERS, moe=False, **parallel) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 4, 32, 4, 64, 16
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    if moe:  # experts on layers 1-3, their weights sharded over the expert-data-parallel group
        m.disable_bias_linear, m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk = True, 4, 16, 2
        m.moe_first_dense_layers, m.moe_aux_loss_coeff = 1, 0.05
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 8, iters, 5, "cpu"
    t.eval_interval, t.eval_iters, t.compile, t.generate_sample = 1000, 0, False, False
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    o = cfg.optim
    o.lr, o.lr_warmup_iters, o.adam_eps, o.weight_decay, o.clip_grad, o.adam_beta2 = 1e-2, 0, 1e-5, 0.1, 0.3, 0.95
    o.lr_decay_style = "constant"  # a run stopped halfway follows the same schedule (resume cases)
    cfg.log.log_interval, cfg.log.quiet, cfg.log.progress_bar = 1, True, False
    ck = cfg.checkpoint
    ck.save, ck.load, ck.save_interval = save, load, (iters if save else None)
    for key, value in parallel.items():
        cfg.set(key, value)
    return cfg


def _measured_vs_planned(trainer) -> dict:
    """This rank's allocated weight / gradient / optimizer bytes and the static memory model's figures."""
    from meshtron.planning.static_memory import rank_memory

    planned = rank_memory(trainer.cfg, trainer.vocab_size, trainer.ctx.world_size, trainer.ctx.rank)
    got = trainer.dp_strategy.allocated()
    state = trainer.optimizer.state_bytes()["device"] if hasattr(trainer.optimizer, "state_bytes") else None
    return {"weights": (got.weights, planned.weights), "gradients": (got.gradients, planned.gradients),
            "optimizer": (state, planned.optimizer.device_bytes if state is not None else None)}


def _compile_counts() -> tuple[int, int]:
    """(frames torch.compile has compiled, graph breaks) in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"], sum(counters["graph_break"].values())


def _run(cfg: MeshtronConfig):
    """(losses, grad norms, allocated vs planned bytes, frames compiled and graph breaks after each step)."""
    from meshtron.training.trainer import Trainer, run_training

    memory, compiles = {}, []
    original_close, original_step = Trainer.close, Trainer.train_step
    start = _compile_counts()

    def close(self):  # record the allocations after training (the Adam moments exist from the first step)
        memory.update(_measured_vs_planned(self))
        original_close(self)

    def train_step(self, *args, **kwargs):
        out = original_step(self, *args, **kwargs)
        compiles.append(tuple(now - before for now, before in zip(_compile_counts(), start)))
        return out

    Trainer.close, Trainer.train_step = close, train_step
    try:
        result = run_training(cfg)
    finally:
        Trainer.close, Trainer.train_step = original_close, original_step
    return result.train_losses, result.grad_norms, memory, compiles


def _worker(rank: int, world: int, cases: list) -> list:
    return [_run(_config(**kwargs)) for _, kwargs in cases]


def _checkpoint_tensors(directory: str) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = directory.rstrip("/") + ".tensors.pt"  # beside the checkpoint, not a checkpoint directory
    if not os.path.exists(path):
        dcp_to_torch_save(directory, path)
    return {k: v for k, v in torch.load(path, weights_only=False).items()
            if isinstance(v, torch.Tensor) and (k.startswith("model.") or k.startswith("optim."))}


def _latest(root: str) -> str:
    return os.path.join(root, sorted(d for d in os.listdir(root)
                                     if d.startswith("iter_") and os.path.isdir(os.path.join(root, d)))[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    pytest.importorskip("meshtron.data.mock")
    from meshtron.training.trainer import run_training

    root = str(tmp_path_factory.mktemp("sharding"))
    os.environ.pop("WORLD_SIZE", None)
    ref_dir = os.path.join(root, "ref")
    ref = run_training(_config(save=ref_dir))
    moe_ref = run_training(_config(moe=True))
    fp8_ref, bf16_ref = run_training(_config(**FP8)), run_training(_config(bf16=True))
    half = ITERS // 2
    cases = [
        ("dp4_optim_grads_offload", dict(data_parallel_sharding_strategy="optim_grads", optimizer_cpu_offload=True,
                                         optimizer_offload_fraction=0.5)),
        ("dp4_zero3", dict(data_parallel_sharding_strategy="optim_grads_params", recompute_granularity="full",
                           recompute_method="uniform", recompute_num_layers=1)),
        ("tp2dp2_zero3", dict(data_parallel_sharding_strategy="optim_grads_params", tensor_model_parallel_size=2,
                              sequence_parallel=True)),
        ("pp2v2dp2_zero3", dict(use_torch_fsdp2=True, pipeline_model_parallel_size=2,
                                virtual_pipeline_model_parallel_size=2)),
        ("cp2dp2_zero3", dict(use_megatron_fsdp=True, context_parallel_size=2)),
        ("ep2_moe_zero3", dict(moe=True, data_parallel_sharding_strategy="optim_grads_params",
                               expert_model_parallel_size=2)),
        ("dp4_zero3_offload", dict(data_parallel_sharding_strategy="optim_grads_params", optimizer_cpu_offload=True,
                                   optimizer_offload_fraction=0.5)),
        ("dp4_zero3_fp8", dict(data_parallel_sharding_strategy="optim_grads_params", **FP8)),
        # Resume between strategies and layouts: ZeRO-3 under TP=2 x DP=2 (its shards written by their owners)
        # -> PP=2 x DP=2 distributed optimizer; TP=2 -> ZeRO-3 (DP=4).
        ("zero3_save", dict(data_parallel_sharding_strategy="optim_grads_params", tensor_model_parallel_size=2,
                            sequence_parallel=True, iters=half, save=os.path.join(root, "z3"))),
        ("pp2_load", dict(pipeline_model_parallel_size=2, use_distributed_optimizer=True,
                          load=os.path.join(root, "z3"))),
        ("tp2_save", dict(tensor_model_parallel_size=2, iters=half, save=os.path.join(root, "tp2"))),
        ("zero3_load", dict(use_megatron_fsdp=True, load=os.path.join(root, "tp2"),
                            save=os.path.join(root, "z3_final"))),
    ]
    if HAVE_CXX:  # torch.compile on CPU needs a C++ compiler
        # Layers 0-1 recompute inside the compiled backward, layers 2-3 keep the weights it saved.
        cases.append(("dp4_zero3_compiled", dict(data_parallel_sharding_strategy="optim_grads_params", compile=True,
                                                 recompute_granularity="full", recompute_method="block",
                                                 recompute_num_layers=2)))
    for name, kwargs in cases:
        if "save" not in kwargs and "load" not in kwargs and not kwargs.get("moe") and not kwargs.get("fp8_format"):
            kwargs["save"] = os.path.join(root, name)
    results = run_distributed(_worker, WORLD, cases, timeout=400)
    refs = {"moe": moe_ref, "fp8": fp8_ref, "bf16": bf16_ref}
    return root, ref, ref_dir, refs, {name: [r[i] for r in results] for i, (name, _) in enumerate(cases)}


def _assert_logs(per_rank, ref, iterations, rel: float = 1e-5) -> None:
    for rank, (losses, norms, *_) in enumerate(per_rank):
        for it in iterations:
            assert losses[it] == pytest.approx(ref.train_losses[it], rel=rel), f"rank {rank} iteration {it} loss"
            assert norms[it] == pytest.approx(ref.grad_norms[it], rel=rel), f"rank {rank} iteration {it} norm"


LAYOUTS = ["dp4_optim_grads_offload", "dp4_zero3", "tp2dp2_zero3", "pp2v2dp2_zero3", "cp2dp2_zero3",
           "dp4_zero3_offload",
           pytest.param("dp4_zero3_compiled", marks=pytest.mark.skipif(not HAVE_CXX, reason="needs a C++ compiler"))]


@pytest.mark.parametrize("name", LAYOUTS)
def test_strategy_trains_the_single_process_model(runs, name):
    root, ref, ref_dir, _, results = runs
    _assert_logs(results[name], ref, range(1, ITERS + 1))
    want = _checkpoint_tensors(_latest(ref_dir))
    got = _checkpoint_tensors(_latest(os.path.join(root, name)))
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} {key}: {m}")


def test_checkpoints_resume_across_strategies(runs):
    root, ref, ref_dir, _, results = runs
    half = ITERS // 2
    _assert_logs(results["zero3_save"], ref, range(1, half + 1))
    _assert_logs(results["pp2_load"], ref, range(half + 1, ITERS + 1))
    _assert_logs(results["tp2_save"], ref, range(1, half + 1))
    _assert_logs(results["zero3_load"], ref, range(half + 1, ITERS + 1))
    want = _checkpoint_tensors(_latest(ref_dir))
    got = _checkpoint_tensors(_latest(os.path.join(root, "z3_final")))
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("name", ["dp4_optim_grads_offload", "dp4_zero3", "tp2dp2_zero3", "pp2v2dp2_zero3",
                                  "ep2_moe_zero3", "pp2_load", "dp4_zero3_offload"])
def test_allocated_bytes_equal_the_memory_model(runs, name):
    _, _, _, _, results = runs
    for rank, (_, _, memory, _) in enumerate(results[name]):
        for kind, (got, planned) in memory.items():
            assert got == planned, f"{name} rank {rank}: {kind} allocated {got} bytes, the model predicts {planned}"


def test_expert_weights_shard_over_the_expert_data_parallel_group(runs):
    _, _, _, refs, results = runs
    _assert_logs(results["ep2_moe_zero3"], refs["moe"], range(1, ITERS + 1))


@pytest.mark.skipif(not HAVE_CXX, reason="torch.compile on CPU needs a C++ compiler")
def test_zero3_gathers_outside_compiled_layers_without_recompiling(runs):
    """The gather and free run around the compiled call: the layers compile once, whole, in the first step."""
    _, _, _, _, results = runs
    for rank, (_, _, _, compiles) in enumerate(results["dp4_zero3_compiled"]):
        (first, _), (last, breaks) = compiles[0], compiles[-1]
        assert first >= 1, f"rank {rank}: nothing was compiled"
        assert last == first, f"rank {rank}: {last - first} frames compiled after the first step"
        assert breaks == 0, f"rank {rank}: {breaks} graph breaks in the compiled layers"


def test_zero3_with_fp8_linears_trains_the_single_process_fp8_model(runs):
    """The weights are gathered in bf16 and cast to FP8 per micro-batch, as without sharding."""
    _, _, _, refs, results = runs
    _assert_logs(results["dp4_zero3_fp8"], refs["fp8"], range(1, ITERS + 1), rel=1e-4)
    losses = results["dp4_zero3_fp8"][0][0]
    assert losses[ITERS] != pytest.approx(refs["bf16"].train_losses[ITERS], rel=1e-5)  # FP8 is on


@pytest.mark.parametrize("extra", [["--compile", "--device", "cpu"],
                                   ["--fp8-format", "e4m3", "--bf16", "--device", "cpu"],
                                   ["--compile", "--fp8-format", "hybrid", "--bf16", "--device", "cpu"]])
def test_zero3_configuration_accepts_compiled_layers_and_fp8(extra):
    from meshtron.cli import build_config
    from meshtron.run_layout import sharding_strategy
    from meshtron.validation import validate_config

    cfg = build_config(["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                        "--data-parallel-sharding-strategy", "optim_grads_params"] + extra)
    validate_config(cfg, 4)
    assert sharding_strategy(cfg) == "optim_grads_params"


# ------------------------------------------------------------------------------------------------
# On the GPU: ZeRO-3's gathers prefetched on a side stream, overlapped reduce-scatters, and compiled layers,
# over NCCL on two GPUs or with both ranks on one GPU (tests/distributed/staged_group.py).

GPU_CASES = [
    # With optim_grads_params each layer's gather is always prefetched; the gradients' reduce-scatters overlap.
    ("dp2_zero3_prefetch", dict(data_parallel_sharding_strategy="optim_grads_params", overlap_grad_reduce=True)),
    ("dp2_zero3_prefetch_compiled", dict(data_parallel_sharding_strategy="optim_grads_params", compile=True,
                                         overlap_grad_reduce=True)),
]


def _gpu_worker(rank: int, world: int, cases: list) -> list:
    return [_run(_config(device="cuda", **kwargs))[:2] for _, kwargs in cases]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")
def test_zero3_prefetch_on_the_gpu_trains_the_one_gpu_model():
    from meshtron.training.trainer import run_training

    torch.backends.cuda.matmul.allow_tf32 = False
    os.environ.pop("WORLD_SIZE", None)
    # Each case against one GPU running the same code (compiled kernels round differently from eager ones).
    refs = {compiled: run_training(_config(device="cuda", compile=compiled)) for compiled in (False, True)}
    results = run_distributed(_gpu_worker, 2, GPU_CASES, backend="nccl", timeout=600)
    for i, (name, kwargs) in enumerate(GPU_CASES):
        ref = refs[kwargs.get("compile", False)]
        for rank, per_case in enumerate(results):
            losses, norms = per_case[i]
            for it in range(1, ITERS + 1):
                assert losses[it] == pytest.approx(ref.train_losses[it], rel=1e-4), f"{name} rank {rank} loss {it}"
                assert norms[it] == pytest.approx(ref.grad_norms[it], rel=1e-4), f"{name} rank {rank} norm {it}"
