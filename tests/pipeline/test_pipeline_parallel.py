"""Pipeline parallelism equals the one-process run: losses, every gradient, parameters after
optimizer steps, the evaluation loss; tied embeddings stay equal across stages; each stage holds
no more micro-batches than its schedule allows (DESIGN.md section 4)."""

from __future__ import annotations

import pytest
import torch

from meshtron.parallel.context import ParallelContext
from meshtron.pipeline.schedules import interleaved_warmup
from pipeline_helpers import layout_worker, model_config, run_config, train_and_collect
from tests.distributed.launch import run_distributed

LLAMA_TIED = model_config(tied=True)
LLAMA_UNTIED = model_config(tied=False)
GPT_TIED = model_config(tied=True, gpt=True)

# Data-parallel reduction started inside the last backward pass, in small buckets (several per chunk).
OVERLAP = dict(overlap_grad_reduce=True, ddp_bucket_size=2048)

# (name, config): configs of one world size run together, in one set of processes (process start-up
# dominates on CPU). With four processes, PP=2 layouts also have DP=2; the trainer test covers DP=1.
WORLD_4 = [
    ("pp4-1f1b", run_config(LLAMA_TIED, pp=4)),
    ("pp4-1f1b-gpt-untied", run_config(model_config(tied=False, gpt=True), pp=4, global_batch=4)),
    ("pp4-interleaved-v2-8-layers", run_config(model_config(layers=8), pp=4, vpp=2)),
    ("pp2-dp2-1f1b", run_config(LLAMA_TIED, pp=2)),
    ("pp2-dp2-1f1b-untied-micro-batch-2", run_config(LLAMA_UNTIED, pp=2, micro_batch=2)),
    ("pp2-dp2-interleaved-v2", run_config(LLAMA_TIED, pp=2, vpp=2)),
    ("pp2-dp2-uneven-first1-gpt", run_config(GPT_TIED, pp=2, first=1)),
    ("pp2-dp2-uneven-last1-fewer-micro-batches-than-stages", run_config(LLAMA_UNTIED, pp=2, last=1, global_batch=2)),
    ("pp2-dp2-interleaved-v2-overlapped-grad-reduce", run_config(LLAMA_TIED, pp=2, vpp=2, **OVERLAP)),
    # Point-to-point transfers posted without waiting (--overlap-p2p-comm).
    ("pp4-interleaved-v2-overlap-p2p", run_config(model_config(layers=8), pp=4, vpp=2, overlap_p2p_comm=True)),
    ("pp2-dp2-1f1b-overlap-p2p", run_config(LLAMA_UNTIED, pp=2, overlap_p2p_comm=True)),
    # Megatron's accounting splits: 5 layers + the loss's slot -> 3 + 2 layers; 6 layers + both slots over
    # 2 x 2 chunks -> chunks of 1, 2, 2, 1 layers (unequal chunks within a stage).
    ("pp2-dp2-loss-slot", run_config(model_config(layers=5), pp=2, account_for_loss_in_pipeline_split=True)),
    ("pp2-dp2-interleaved-v2-embedding-and-loss-slots",
     run_config(model_config(layers=6, tied=False), pp=2, vpp=2, account_for_embedding_in_pipeline_split=True,
                account_for_loss_in_pipeline_split=True, overlap_p2p_comm=True)),
    # Megatron's --pipeline-model-parallel-layout: chunks of 2, 1 | 1, 2 layers (stage 0 holds layers 0, 1 and 3).
    ("pp2-dp2-layout-string", run_config(model_config(layers=6, tied=False), pp=2, vpp=2,
                                         pipeline_model_parallel_layout="Ett|t|t|ttL")),
    # chunks without layers, as megatron-core allows: stage 0 holding the (tied) embedding alone; a chunk holding
    # nothing (passes its input on) and the loss alone
    ("pp2-dp2-layout-embedding-stage-tied", run_config(model_config(layers=4, tied=True), pp=2,
                                                       pipeline_model_parallel_layout="E|ttttL")),
    ("pp2-dp2-layout-nothing-in-a-chunk", run_config(model_config(layers=4, tied=True), pp=2, vpp=2,
                                                     pipeline_model_parallel_layout="Ett||tt|L")),
]
WORLD_8 = [
    ("tp2-pp2-dp2-sp", run_config(LLAMA_TIED, tp=2, pp=2, sp=True)),
    ("tp2-pp2-dp2-sp-interleaved-v2-distributed-optimizer",
     run_config(LLAMA_UNTIED, tp=2, pp=2, vpp=2, sp=True, use_distributed_optimizer=True, overlap_param_gather=True,
                **OVERLAP)),
    ("tp2-pp2-dp2-sp-interleaved-v2-overlap-p2p",
     run_config(LLAMA_TIED, tp=2, pp=2, vpp=2, sp=True, overlap_p2p_comm=True, **OVERLAP)),
]


def reference(cfg) -> dict:
    """The same training on one process (no parallelism), same global batches."""
    one = run_config(cfg.model, micro_batch=cfg.train.micro_batch_size, global_batch=cfg.train.global_batch_size)
    return train_and_collect(one, ParallelContext())


def assert_close_dict(got: dict, ref: dict, what: str, rtol=2e-5, atol=2e-6) -> None:
    assert got.keys() == ref.keys(), f"{what}: names differ: {set(got) ^ set(ref)}"
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")


def expected_in_flight(cfg, stage: int, dp: int) -> int:
    """The schedule's bound on forwards awaiting their backward: 1F1B PP - r; interleaved
    2 (PP - r - 1) + (V - 1) PP + 1 chunk-forwards; never more than the passes there are."""
    pp, v = cfg.parallel.pipeline_model_parallel_size, cfg.parallel.virtual_pipeline_model_parallel_size or 1
    m = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    if v == 1:
        return min(pp - stage, m)
    return min(m * v, interleaved_warmup(pp, stage, v) + 1)


def check_layout(name: str, cfg, results: list[dict], world: int) -> None:
    ref = reference(cfg)
    dp = world // (cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size)
    for rank, out in enumerate(results):
        where = f"{name} rank {rank}"
        # The logged loss is the same on every rank (broadcast from the last stage).
        torch.testing.assert_close(out["losses"], ref["losses"], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
        torch.testing.assert_close(out["eval_loss"], ref["eval_loss"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out["norms"], ref["norms"], rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
        if "grads" in out:
            assert_close_dict(out["grads"], ref["grads"], f"{where} gradient")
        # Adam normalises each step to about lr (1e-2): a wrong gradient moves a weight by ~1e-2, while
        # rounding differences in tiny gradients move it by ~1e-6.
        assert_close_dict(out["params"], ref["params"], f"{where} parameter", rtol=1e-4, atol=1e-5)
        if cfg.parallel.overlap_grad_reduce:  # some reductions started inside the last backward pass
            assert out["buckets_in_backward"] > 0, where
        if cfg.parallel.pipeline_model_parallel_size > 1:
            assert out["max_in_flight"] == expected_in_flight(cfg, out["stage"], dp), where
    if not cfg.model.untie_embeddings_and_output_weights:
        # The first stage's embedding and the last stage's copy (same TP rank) are equal after the steps.
        first = [r for r in results if r["stage"] == 0]
        last = [r for r in results if r["stage"] == cfg.parallel.pipeline_model_parallel_size - 1]
        for a, b in zip(first, last):
            assert len(a["tied"]) == len(b["tied"]) == 1
            torch.testing.assert_close(a["tied"][0], b["tied"][0], rtol=0, atol=0)


# The eight-rank layouts are slow; the four-rank ones are the fast representatives.
@pytest.mark.parametrize("world,cases", [(4, WORLD_4), pytest.param(8, WORLD_8, marks=pytest.mark.slow)],
                         ids=["world4", "world8"])
def test_pipeline_matches_single_process(world, cases):
    results = run_distributed(layout_worker, world, [cfg for _, cfg in cases], timeout=300)
    for i, (name, cfg) in enumerate(cases):
        check_layout(name, cfg, [per_rank[i] for per_rank in results], world)
