"""The gradient buffer freed between steps (``--release-grad-buffer``, the default with a full buffer).

Its buckets are allocated when backward reaches them and freed when the next iteration starts; the sums it
holds equal the persistent buffer's bit for bit (over accumulated micro-batches, with parameters that
get no gradient), and training through the trainer is unchanged.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from meshtron.cli import build_config
from meshtron.optim.buckets import build_layout
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import SPEC_ATTR, ShardSpec, whole
from meshtron.training.trainer import run_training


def _param(name: str, numel: int) -> nn.Parameter:
    p = nn.Parameter(torch.randn(numel))
    setattr(p, SPEC_ATTR, ShardSpec((whole(name, (numel,)),)))
    return p


class _Two(nn.Module):
    """Two parameters in separate buckets; ``second_only`` leaves the first without a gradient."""

    def __init__(self):
        super().__init__()
        self.first = _param("first", 6)
        self.second = _param("second", 6)

    def forward(self, x, second_only=False):
        y = x * (self.first.detach() if second_only else self.first)
        return ((y * self.second).sin()).sum()


def _buffer(model: nn.Module, release: bool) -> GradBuffer:
    params = list(model.parameters())
    layout = build_layout([params], ParallelContext(), bucket_size=4)
    assert len(layout.buckets) == 2
    return GradBuffer(params, layout=layout, release=release)


def _bucket_bytes(buffer: GradBuffer) -> list[int]:
    return [piece.untyped_storage().nbytes() for piece in buffer._pieces]


def _full(buffer: GradBuffer) -> list[int]:
    return [piece.numel() * piece.element_size() for piece in buffer._pieces]


def test_released_buckets_hold_what_the_persistent_buffer_holds():
    results, buffers = {}, {}
    for release in (False, True):
        torch.manual_seed(1)
        model = _Two()
        buffer = buffers[release] = _buffer(model, release)
        sums = []
        for step in range(3):
            buffer.zero()
            for micro in range(2):  # accumulated micro-batches; the last step's first parameter gets none
                model(torch.randn(6), second_only=step == 2).backward()
            buffer.zero_unwritten()
            sums.append([p.main_grad.clone() for p in model.parameters()])
            if release:
                assert _bucket_bytes(buffer) == _full(buffer)
            buffer.release()
            if release:
                assert _bucket_bytes(buffer) == [0, 0]
        results[release] = sums
    for a, b in zip(results[False], results[True]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert torch.equal(results[True][2][0], torch.zeros(6))  # no gradient: zeroed, not last step's
    assert buffers[False].data is not None and buffers[True].data is None


def test_backward_allocates_only_the_buckets_it_reaches():
    model = _Two()
    buffer = _buffer(model, release=True)
    buffer.release()
    model(torch.randn(6), second_only=True).backward()
    bucket_of_second = buffer._bucket_of[1]
    sizes = _bucket_bytes(buffer)
    assert sizes[bucket_of_second] == _full(buffer)[bucket_of_second] and sizes[1 - bucket_of_second] == 0
    buffer.tensors()  # allocated and zeroed on request
    assert _bucket_bytes(buffer) == _full(buffer)
    assert torch.equal(model.first.main_grad, torch.zeros(6))
    assert buffer.bytes() == sum(_full(buffer))


MOCK = ["--mock-data", "--vocab-size", "256", "--model", "tiny", "--seq-length", "32", "--device", "cpu",
        "--log-interval", "1", "--no-generate-sample", "--train-iters", "3", "--eval-interval", "0",
        "--ddp-bucket-size", "20000"]


def test_training_is_unchanged_by_releasing_the_buffer():
    """One micro-batch per step and two, with clipping, with the distributed optimizer (whose segments view the
    released buckets; the gradients read after the step for --log-num-zeros-in-grad) and half of it offloaded to
    the CPU: the same losses exactly."""
    one = ["--micro-batch-size", "4", "--global-batch-size", "4"]
    for batch in (one, ["--micro-batch-size", "2", "--global-batch-size", "4", "--clip-grad", "0.5"],
                  one + ["--use-distributed-optimizer", "--clip-grad", "0.5", "--log-num-zeros-in-grad"],
                  one + ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"]):
        runs = [run_training(build_config(MOCK + batch + extra))
                for extra in ([], ["--no-release-grad-buffer"])]
        assert runs[0].train_losses == runs[1].train_losses
        assert len(runs[0].train_losses) == 3


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_the_weights_move_into_their_flat_buffer_before_any_gradient_storage_exists(strategy, monkeypatch):
    """While the weights are copied into the flat buffer they exist twice; with the gradients already beside them
    that moment was a million-token llama3-8b rank's peak (15 GiB of weights twice and 30 GiB of fp32
    gradients). The flat weights come first, so the moment holds only the weights."""
    import meshtron.optim.strategy as strategy_module

    events = []

    class Weights(strategy_module.ParamBuffer):
        def __init__(self, *args, **kwargs):
            events.append("weights")
            super().__init__(*args, **kwargs)

    class Gradients(strategy_module.GradBuffer):
        def __init__(self, *args, **kwargs):
            events.append("gradients")
            super().__init__(*args, **kwargs)

    class GradientShards(strategy_module.ShardedGradients):
        def __init__(self, *args, **kwargs):
            events.append("gradients")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(strategy_module, "ParamBuffer", Weights)
    monkeypatch.setattr(strategy_module, "GradBuffer", Gradients)
    monkeypatch.setattr(strategy_module, "ShardedGradients", GradientShards)
    model = _Two()
    params = list(model.parameters())
    ctx = ParallelContext()
    layout = build_layout([params], ctx, bucket_size=4)
    built = strategy_module.build_strategy(strategy, [model], layout, ctx, torch.float32)
    assert events == ["weights", "gradients"]
    assert all(p.data.data_ptr() == built.param_buffer.view_of(i).data_ptr() for i, p in enumerate(params))
    built.remove_hooks()
