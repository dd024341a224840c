"""--enable-cuda-graph: where it is refused (CPU), which layers it graphs, and (on a GPU) that graphed layers train
the same model as compiled layers without graphs: fp32 through the schedule with gradient accumulation and an
evaluation pass, and bf16 FP8 through the trainer."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from meshtron import validation
from meshtron.build import build_model_chunks, compile_options
from meshtron.cli import build_config
from meshtron.config import ConfigError
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.random import RNGTracker
from meshtron.validation import validate_config
from tests.pipeline.pipeline_helpers import VOCAB, model_config, run_config, train_and_collect

SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
         "--max-position-embeddings", "16", "--vocab-size", "128", "--micro-batch-size", "1",
         "--global-batch-size", "2"]
GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("extra, message", [
    (["--device", "cpu"], "--enable-cuda-graph needs --device cuda and compiled layers"),
    (["--no-compile"], "--enable-cuda-graph needs --device cuda and compiled layers"),
    (["--tensor-model-parallel-size", "2"], "--enable-cuda-graph needs --tensor-model-parallel-size 1 (got 2)"),
    (["--context-parallel-size", "2"], "--enable-cuda-graph needs --context-parallel-size 1 (got 2)"),
    (["--pipeline-model-parallel-size", "2"], "--enable-cuda-graph needs --pipeline-model-parallel-size 1 (got 2)"),
    (["--offload-activations"], "--enable-cuda-graph and --offload-activations exclude each other"),
    (["--use-megatron-fsdp"], "does not work with --data-parallel-sharding-strategy optim_grads_params"),
])
def test_cuda_graphs_are_refused_where_a_graph_cannot_hold_the_layer(monkeypatch, extra, message):
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)  # only the config is checked
    cfg = build_config(SHAPE + ["--enable-cuda-graph"] + extra)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_config(cfg, 2)


def test_cuda_graphs_validate_on_one_gpu_with_data_parallel_ranks(monkeypatch):
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)
    cfg = build_config(SHAPE + ["--enable-cuda-graph", "--use-distributed-optimizer"])
    validate_config(cfg, 2)
    assert cfg.train.enable_cuda_graph and cfg.train.compile


def test_dense_layers_are_graphed_and_expert_layers_are_not():
    cfg = run_config(model_config(layers=2))
    cfg.model.num_experts, cfg.model.moe_ffn_hidden_size, cfg.model.moe_first_dense_layers = 4, 32, 1
    cfg.model.moe_router_topk = 2
    validate_config(cfg, 1)
    ctx = ParallelContext(device=torch.device("cpu"))
    tracker = RNGTracker(cfg.train.seed, 0, 0, ctx.device)
    (model,) = build_model_chunks(cfg, ctx, VOCAB, tracker, torch.float32)
    dense, moe = model.layers["0"], model.layers["1"]
    assert compile_options(dense, cuda_graphs=True) == {"mode": "reduce-overhead"}
    assert compile_options(moe, cuda_graphs=True) == {}
    assert compile_options(dense, cuda_graphs=False) == {}


def assert_layers_were_graphed() -> None:
    """The last run recorded graphs and skipped none (torch.compile falls back to plain code when it cannot
    capture a region, e.g. one that reads a CPU tensor or mutates an input, and only logs why)."""
    from torch._inductor.cudagraph_trees import get_container

    assert counters["inductor"]["cudagraph_skips"] == 0
    manager = get_container(torch.cuda.current_device()).tree_manager
    assert manager is not None and any(manager.roots.values())


@GPU
@pytest.mark.gpu
@pytest.mark.parametrize("recompute", [None, "full", "selective"])
def test_cuda_graph_layers_train_as_compiled_layers_on_one_gpu(recompute):
    """Four micro-batches per step (the graphs replay between backward passes), three steps, then evaluation;
    also with the layers recomputed (inside the graphed region) in backward."""
    torch.backends.cuda.matmul.allow_tf32 = False
    results = []
    for graphs in (False, True):
        cfg = run_config(model_config(), micro_batch=2, global_batch=8, device="cuda", compile=True)
        cfg.train.enable_cuda_graph = graphs
        cfg.train.recompute_granularity = recompute
        validate_config(cfg, 1)
        counters.clear()
        results.append(train_and_collect(cfg, ParallelContext(device=torch.device("cuda", 0)), iterations=3))
    assert_layers_were_graphed()
    plain, graphed = results
    torch.testing.assert_close(graphed["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(graphed["eval_loss"], plain["eval_loss"], rtol=1e-5, atol=1e-6)
    for name in plain["grads"]:
        torch.testing.assert_close(graphed["grads"][name], plain["grads"][name], rtol=1e-4, atol=1e-6)
    for name in plain["params"]:
        torch.testing.assert_close(graphed["params"][name], plain["params"][name], rtol=1e-4, atol=1e-6)


@GPU
@pytest.mark.gpu
def test_cuda_graph_layers_train_fp8_through_the_trainer():
    from meshtron.bench import RandomTokens
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer

    losses = []
    for graphs in ([], ["--enable-cuda-graph"]):
        cfg = build_config(["--model", "llama3-1b", "--num-layers", "2", "--hidden-size", "256",
                            "--ffn-hidden-size", "512", "--num-attention-heads", "4", "--num-query-groups", "2",
                            "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
                            "--bf16", "--fp8-format", "e4m3", "--mock-data", "--eval-interval", "0",
                            "--train-iters", "10", "--lr", "1e-3"] + graphs)
        validate_config(cfg, 1)
        ctx = context_from_config(cfg)
        data = RandomTokens(cfg.model.vocab_size, cfg.model.seq_length, 2, 2, 0)
        trainer = Trainer(cfg, ctx, data=data)
        batches = next(data.train_batches())
        counters.clear()
        run = [float(trainer.train_step(batches, i + 1)[0]) for i in range(4)]
        losses.append(run)
        trainer.close()
    assert_layers_were_graphed()
    assert losses[1][-1] < losses[1][0]
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=0)
