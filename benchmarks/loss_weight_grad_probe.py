"""Time the fused loss's last step on the output weight's gradient: the fp32 sum scaled by the upstream gradient
and rounded to bf16. Before: a cast copy, then an in-place multiply by a one-element tensor (two passes, the
second not vectorised); now: one compiled pass (meshtron.layers.cross_entropy._scaled_weight_grad_fast).

    python benchmarks/loss_weight_grad_probe.py   (one CUDA GPU; shapes of the DeepSeek-V3 and llama3-1b heads)
"""

import torch

from meshtron.layers.cross_entropy import _scaled_weight_grad_fast


def cast_then_scale(grad_weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return grad_weight.to(torch.bfloat16, copy=True).mul_(scale.to(torch.bfloat16))


def one_pass(grad_weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _scaled_weight_grad_fast(grad_weight, scale, torch.bfloat16)


def time_ms(fn, *args, reps: int = 20) -> float:
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    print(torch.cuda.get_device_name())
    for name, shape in (("DeepSeek-V3 head", (129280, 7168)), ("llama3-1b head", (128256, 2048))):
        grad = torch.randn(shape, device="cuda")
        scale = torch.ones((), device="cuda")
        assert torch.equal(cast_then_scale(grad, scale), one_pass(grad, scale))
        before, after = time_ms(cast_then_scale, grad, scale), time_ms(one_pass, grad, scale)
        gb = grad.numel() * 6 / 1e9  # one fp32 read and one bf16 write at the least
        print(f"{name} {list(shape)}: cast then scale {before:.3f} ms, one pass {after:.3f} ms "
              f"({gb / (after / 1e3):.0f} GB/s)")


if __name__ == "__main__":
    main()
