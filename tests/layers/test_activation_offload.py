"""Activation offloading (--offload-activations): the saved tensors of every layer but a chunk's last go to host
buffers and come back for the backward; losses and gradients are bit-identical to a run without it, in one
process and through the trainer under tensor + sequence and interleaved pipeline parallelism."""

from __future__ import annotations

import shutil

import pytest
import torch

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.errors import ConfigError
from meshtron.layers.activation_offload import ActivationOffloader, OffloadGroup, is_dense
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from meshtron.validation import validate_config
from tests.distributed.launch import run_distributed


def tiny(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
                ffn_hidden_size=64, seq_length=16, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
                disable_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0,
                untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=8)
    base.update(kw)
    return ModelConfig(**base)


def _model(offload: bool, compile_layers: bool = False) -> tuple[GPTModel, ActivationOffloader | None]:
    model = GPTModel(tiny(), ParallelContext(), 96)
    initialize_parameters(model, 3, torch.device("cpu"), torch.float32)
    offloader = None
    if offload:
        offloader = model.activation_offloader = ActivationOffloader(model, torch.device("cpu"))
    if compile_layers:
        for layer in model.layers.values():
            layer.compile()
    return model, offloader


def _step(model: GPTModel) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 96, (2, 16), generator=g)
    labels = torch.randint(0, 96, (2, 16), generator=g)
    loss, _ = model(tokens=tokens, labels=labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_offloaded_layers_give_bit_identical_loss_and_gradients():
    ref_loss, ref_grads = _step(_model(False)[0])
    model, offloader = _model(True)
    loss, grads = _step(model)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert torch.equal(grads[name], ref_grads[name]), name
    # Three of the four layers offload (the last keeps its own); each saves several activations.
    assert offloader.offloaded_tensors >= 3 * 4
    assert offloader.offloaded_bytes > 0


def test_parameters_and_the_last_layer_stay_on_the_device():
    model, offloader = _model(True)
    groups = []
    fetch = offloader.fetch_when_backward_reaches
    offloader.fetch_when_backward_reaches = lambda out, group, prev: (groups.append(group), fetch(out, group, prev))
    _step(model)
    assert len(groups) == 4 and all(g.saved for g in groups[:3]) and not groups[3].saved
    assert all(s.host is None for g in groups for s in g.saved)  # every offloaded tensor came back once
    weight = model.layers["0"].attention.o.weight
    assert offloader._pack(weight, OffloadGroup()) is weight
    view = weight.detach()[1:]  # a view of a parameter (a compiled layer may save one)
    assert offloader._pack(view, OffloadGroup()) is view
    group = OffloadGroup()
    assert offloader._pack(weight.detach().clone(), group) is group.saved[0]  # an activation-like copy moves


def test_transposed_activations_move_in_their_own_layout_and_strided_views_stay():
    """The attention kernel's output is a transposed view of its storage: it moves, with its strides (one
    block each way); a view with gaps (every other column) stays on the device."""
    offloader = ActivationOffloader(torch.nn.Linear(2, 2), torch.device("cpu"))
    stored = torch.randn(2, 16, 4, 8)  # [b, s, heads, d], as the kernel writes it
    transposed = stored.transpose(1, 2)  # [b, heads, s, d]: not contiguous, but dense
    gappy = stored[..., ::2]
    assert is_dense(transposed) and not transposed.is_contiguous() and not is_dense(gappy)
    group = OffloadGroup()
    packed = offloader._pack(transposed, group)
    assert packed is group.saved[0] and packed.host.stride() == transposed.stride()
    assert offloader._pack(gappy, group) is gappy
    back = offloader._unpack(packed)
    assert torch.equal(back, transposed) and back.stride() == transposed.stride()


def test_num_layers_limits_the_offloaded_layers():
    offloader = ActivationOffloader(torch.nn.Linear(2, 2), torch.device("cpu"), num_layers=2)
    assert [offloader.offloads(i, 4) for i in range(4)] == [True, True, False, False]
    assert [offloader.offloads(i, 2) for i in range(2)] == [True, False]  # never a chunk's last layer
    every = ActivationOffloader(torch.nn.Linear(2, 2), torch.device("cpu"))
    assert [every.offloads(i, 3) for i in range(3)] == [True, True, False]


def test_a_second_read_of_an_offloaded_activation_is_refused():
    model, _ = _model(True)
    tokens = torch.randint(0, 96, (1, 16))
    loss, _ = model(tokens=tokens, labels=tokens)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="read a second time"):
        loss.backward()


@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_layers_offload_their_saved_tensors_too():
    ref_loss, ref_grads = _step(_model(False, compile_layers=True)[0])
    model, offloader = _model(True, compile_layers=True)
    loss, grads = _step(model)
    assert offloader.offloaded_tensors > 0
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=0, atol=0)


@pytest.mark.parametrize("change,match", [
    (dict(recompute_granularity="full"), "would move nothing"),
    (dict(offload_activations_num_layers=0), "--offload-activations-num-layers needs"),
])
def test_bad_combinations_name_the_flags(change, match):
    cfg = MeshtronConfig(model=tiny(vocab_size=96))
    cfg.data.mock_data = True
    cfg.train.offload_activations = True
    for key, value in change.items():
        setattr(cfg.train, key, value)
    with pytest.raises(ConfigError, match=match):
        validate_config(cfg, 1)


def test_offload_modules_needs_offloading():
    from meshtron.cli import build_config

    with pytest.raises(ConfigError, match="--offload-modules needs --offload-activations"):
        build_config(["--mock-data", "--offload-modules", "core_attn"])
    build_config(["--mock-data", "--offload-modules", "core_attn", "--fine-grained-activation-offloading"])


# ----------------------------------------------------------------------------------------------- trainer
def _train_config(offload: bool, tp: int = 1, pp: int = 1, vpp=None) -> MeshtronConfig:
    cfg = MeshtronConfig(model=tiny(vocab_size=96))
    p = cfg.parallel
    p.tensor_model_parallel_size, p.pipeline_model_parallel_size = tp, pp
    p.sequence_parallel = tp > 1
    p.virtual_pipeline_model_parallel_size = vpp
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 4, 3, 5, "cpu"
    t.eval_interval, t.eval_iters, t.compile, t.generate_sample = 3, 1, False, False
    t.offload_activations = offload
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.adam_eps = 1e-2, 0, 1e-5
    cfg.log.log_interval, cfg.log.quiet, cfg.log.progress_bar = 1, True, False
    return cfg


LAYOUTS = {"tp2-sp": dict(tp=2), "pp2-interleaved": dict(pp=2, vpp=2)}


def _layouts_worker(rank: int, world: int) -> dict:
    from meshtron.training.trainer import run_training

    out = {}
    for name, layout in LAYOUTS.items():
        result = run_training(_train_config(True, **layout))
        out[name] = (result.train_losses, result.eval_losses)
    return out


def test_trainer_with_offloading_logs_the_one_process_losses():
    from meshtron.training.trainer import run_training

    ref = run_training(_train_config(False))
    assert len(ref.train_losses) == 3
    for rank, results in enumerate(run_distributed(_layouts_worker, 2, timeout=300)):
        for name, (train, evals) in results.items():
            assert train == pytest.approx(ref.train_losses, rel=1e-5), f"{name} rank {rank}"
            assert evals == pytest.approx(ref.eval_losses, rel=1e-5), f"{name} rank {rank}"


# ----------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_offloading_lowers_the_peak_and_keeps_the_gradients():
    device = torch.device("cuda")
    cfg = tiny(num_layers=6, hidden_size=512, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=2048,
               seq_length=2048)

    def run(offload: bool):
        torch.manual_seed(0)
        model = GPTModel(cfg, ParallelContext(), 1024)
        initialize_parameters(model, 3, device, torch.float32)
        if offload:
            model.activation_offloader = ActivationOffloader(model, device)
        tokens = torch.randint(0, 1024, (2, 2048), device=device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss, _ = model(tokens=tokens, labels=tokens)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        return peak, loss.detach(), [p.grad.clone() for p in model.parameters()]

    peak_ref, loss_ref, grads_ref = run(False)
    peak, loss, grads = run(True)
    assert torch.equal(loss, loss_ref)
    for a, b in zip(grads, grads_ref):
        assert torch.equal(a, b)
    assert peak < 0.7 * peak_ref, (peak, peak_ref)


def test_the_builder_gives_every_chunk_its_offloader():
    from meshtron.build import build_model_chunks
    from meshtron.parallel.random import RNGTracker

    cfg = _train_config(True)
    chunks = build_model_chunks(cfg, ParallelContext(), 96, RNGTracker(5, 0, 0, torch.device("cpu")), torch.float32)
    assert all(isinstance(c.activation_offloader, ActivationOffloader) for c in chunks)
    assert build_model_chunks(_train_config(False), ParallelContext(), 96, RNGTracker(5, 0, 0, torch.device("cpu")),
                              torch.float32)[0].activation_offloader is None
