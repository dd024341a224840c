"""--use-precision-aware-optimizer --exp-avg-dtype bf16 --exp-avg-sq-dtype bf16: Adam's moments stored in bf16.

The step's arithmetic (meshtron.optim.fused_adamw.reference_step_, the torch twin of the Triton kernel) equals
torch's AdamW with fp32 moments; with bf16 moments the state is bf16 and half the bytes, the distributed
optimizer over DP=2 steps exactly as one process does, a checkpoint of bf16 moments resumes (into bf16 or fp32
moments), and the flags are checked."""

from __future__ import annotations

import pytest
import torch

from meshtron.config import MeshtronConfig, OptimConfig
from meshtron.errors import ConfigError
from meshtron.optim import fused_adamw
from meshtron.optim.accounting import bytes_per_parameter
from meshtron.optim.optimizer import MixedPrecisionAdamW, moment_dtypes
from meshtron.validation import validate_config
from tests.distributed.launch import run_distributed


def _optim_cfg(**kw) -> OptimConfig:
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, adam_eps=1e-8)
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


@pytest.mark.parametrize("coef", [None, 0.5])
def test_reference_step_is_torch_adamw_with_fp32_moments(coef):
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(257, generator=g)
    grads = [torch.randn(257, generator=g) for _ in range(4)]
    ref = torch.nn.Parameter(w0.clone())
    torch_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, eps=1e-8, foreach=False)
    master, m, v = w0.clone(), torch.zeros(257), torch.zeros(257)
    for step, grad in enumerate(grads, 1):
        ref.grad = grad * coef if coef else grad
        torch_opt.step()
        fused_adamw.reference_step_(master, grad, m, v, None, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                    weight_decay=0.1, step=step,
                                    grad_coef=torch.tensor(coef) if coef else None)
    torch.testing.assert_close(master, ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(m, torch_opt.state[ref]["exp_avg"], rtol=1e-6, atol=1e-8)


def test_bf16_moments_are_bf16_and_follow_the_fp32_run_closely():
    g = torch.Generator().manual_seed(1)
    init = torch.randn(64, 32, generator=g)
    runs = {}
    for dtype in ("fp32", "bf16"):
        cfg = _optim_cfg(use_precision_aware_optimizer=dtype == "bf16", exp_avg_dtype=dtype, exp_avg_sq_dtype=dtype)
        p = torch.nn.Parameter(init.clone())
        opt = MixedPrecisionAdamW([p], cfg, fused=False)
        gen = torch.Generator().manual_seed(2)
        for _ in range(20):
            p.main_grad = torch.randn(64, 32, generator=gen)
            opt.step(1e-2)
        runs[dtype] = (p.detach().clone(), opt.state_tensors(0))
    (w32, s32), (w16, s16) = runs["fp32"], runs["bf16"]
    assert s16["exp_avg"].dtype == torch.bfloat16 and s16["exp_avg_sq"].dtype == torch.bfloat16
    assert s32["exp_avg"].dtype == torch.float32 and s16["master"].dtype == torch.float32
    diff = (w16 - w32).abs().max().item()
    assert 0 < diff < 5e-3, diff  # rounding the moments changes the steps, by little
    torch.testing.assert_close(s16["exp_avg"].float(), s32["exp_avg"], rtol=2e-2, atol=5e-3)


def test_moment_dtypes_and_their_bytes():
    assert moment_dtypes(_optim_cfg()) == (torch.float32, torch.float32)
    assert moment_dtypes(_optim_cfg(exp_avg_dtype="bf16")) == (torch.bfloat16, torch.float32)
    assert bytes_per_parameter(2, 4, 1, moment_bytes=4.0).optimizer_device == 8.0   # fp32 master + 2 + 2
    assert bytes_per_parameter(2, 4, 1).optimizer_device == 12.0
    assert bytes_per_parameter(4, 4, 2, moment_bytes=4.0).optimizer_device == 2.0   # fp32 weights: moments only


def _config(**optim) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 2, 32, 4, 64, 8
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 96, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type, m.disable_bias_linear = "RMSNorm", True, "rope", True
    cfg.data.mock_data = True
    for key, value in optim.items():
        setattr(cfg.optim, key, value)
    return cfg


@pytest.mark.parametrize("optim,match", [
    (dict(exp_avg_dtype="bf16"), "--exp-avg-dtype bf16 needs --use-precision-aware-optimizer"),
    (dict(main_grads_dtype="bf16"), "--main-grads-dtype bf16 needs --use-precision-aware-optimizer"),
    (dict(use_precision_aware_optimizer=True, main_grads_dtype="bf16"), "--main-grads-dtype bf16 needs --bf16"),
    (dict(use_precision_aware_optimizer=True, exp_avg_sq_dtype="bf16", optimizer_cpu_offload=True),
     "with --optimizer-cpu-offload is not implemented"),
])
def test_bad_settings_name_the_flag(optim, match):
    with pytest.raises(ConfigError, match=match):
        validate_config(_config(**optim), 1)


# ----------------------------------------------------------------------------------------------- trainer
BF16 = dict(use_precision_aware_optimizer=True, exp_avg_dtype="bf16", exp_avg_sq_dtype="bf16")


def _train_config(save=None, load=None, iters: int = 4, dist_opt: bool = False, **optim) -> MeshtronConfig:
    cfg = _config(lr=1e-2, lr_warmup_iters=0, lr_decay_style="constant", adam_eps=1e-5, clip_grad=1.0,
                  weight_decay=0.1, **optim)
    cfg.parallel.use_distributed_optimizer = dist_opt
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 4, iters, 5, "cpu"
    t.eval_interval, t.compile, t.generate_sample = 0, False, False
    cfg.data.num_workers = 0
    cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.save_interval = save, load, 2 if save else None
    cfg.log.log_interval, cfg.log.quiet, cfg.log.progress_bar = 1, True, False
    return cfg


def _dp2_worker(rank: int, world: int) -> list[float]:
    from meshtron.training.trainer import run_training

    return run_training(_train_config(dist_opt=True, **BF16)).train_losses


def test_distributed_optimizer_with_bf16_moments_steps_like_one_process():
    from meshtron.training.trainer import run_training

    ref = run_training(_train_config(**BF16)).train_losses
    fp32 = run_training(_train_config()).train_losses
    assert ref[4] != fp32[4]  # the moments' rounding is visible in the losses
    assert ref == pytest.approx(fp32, rel=1e-2)
    for rank, losses in enumerate(run_distributed(_dp2_worker, 2, timeout=300)):
        assert losses == pytest.approx(ref, rel=1e-5), f"rank {rank}"


@pytest.mark.parametrize("moments,dist_opt", [("fp32", False), ("bf16", False), ("bf16", True)])
def test_bf16_main_grads_train_exactly_where_nothing_is_summed(moments, dist_opt):
    """One micro-batch per step on one rank: an fp32 gradient buffer only holds bf16 gradients widened, so bf16
    main grads (read by the optimizer and the norm as they are) give the same steps bit for bit; with four
    micro-batches per step their sums are rounded to bf16 and the losses move a little."""
    from meshtron.training.trainer import run_training

    def losses(batch: int, grads: str) -> dict:
        cfg = _train_config(dist_opt=dist_opt, use_precision_aware_optimizer=True, exp_avg_dtype=moments,
                            exp_avg_sq_dtype=moments, main_grads_dtype=grads)
        cfg.train.bf16, cfg.train.global_batch_size = True, batch
        result = run_training(cfg)
        assert cfg.parallel.grad_reduce_in_bf16 == (grads == "bf16")
        return result.train_losses

    assert losses(1, "bf16") == losses(1, "fp32")
    summed, exact = losses(4, "bf16"), losses(4, "fp32")
    assert summed != exact and summed == pytest.approx(exact, rel=2e-2)


def _dp2_bf16_grads_worker(rank: int, world: int) -> list[float]:
    from meshtron.training.trainer import run_training

    cfg = _train_config(dist_opt=True, main_grads_dtype="bf16", **BF16)
    cfg.train.bf16 = True
    return run_training(cfg).train_losses


def test_bf16_main_grads_over_two_data_parallel_ranks_train_like_one_process():
    """Two ranks sum their micro-batches and each other's gradients in bf16, one process its four micro-batches:
    the same training to bf16 precision."""
    from meshtron.training.trainer import run_training

    cfg = _train_config(dist_opt=True, main_grads_dtype="bf16", **BF16)
    cfg.train.bf16 = True
    ref = run_training(cfg).train_losses
    for rank, losses in enumerate(run_distributed(_dp2_bf16_grads_worker, 2, timeout=300)):
        assert losses == pytest.approx(ref, rel=1e-2), f"rank {rank}"


def test_bf16_moments_resume_from_their_checkpoint(tmp_path):
    from meshtron.training.trainer import run_training

    whole = run_training(_train_config(**BF16)).train_losses
    run_training(_train_config(save=str(tmp_path / "ckpt"), iters=2, **BF16))
    resumed = run_training(_train_config(load=str(tmp_path / "ckpt"), **BF16)).train_losses
    later = {it: loss for it, loss in whole.items() if it > 2}
    assert sorted(resumed) == [3, 4]
    assert resumed == pytest.approx(later, rel=1e-6)
    # The same checkpoint into fp32 moments: loads (the values widen), and trains on.
    widened = run_training(_train_config(load=str(tmp_path / "ckpt"))).train_losses
    assert widened == pytest.approx(later, rel=1e-2)


NEEDS_TRITON_GPU = pytest.mark.skipif(not (torch.cuda.is_available() and fused_adamw.triton is not None),
                                      reason="needs CUDA and Triton")


def _two_states(g: torch.Generator, n: int, moment_dtype: torch.dtype) -> tuple[list, list]:
    """Two equal fp32 masters on CUDA and two pairs of zero moments, for two ways of stepping them."""
    master = torch.randn(n, device="cuda", generator=g)
    moments = [tuple(torch.zeros(n, device="cuda", dtype=moment_dtype) for _ in range(2)) for _ in range(2)]
    return [master.clone(), master.clone()], moments


@pytest.mark.gpu
@NEEDS_TRITON_GPU
@pytest.mark.parametrize("moment_dtype,grad_dtype,coef", [(torch.bfloat16, torch.float32, None),
                                                          (torch.float32, torch.bfloat16, 0.5),
                                                          (torch.bfloat16, torch.bfloat16, 0.5)])
def test_gpu_kernel_equals_its_torch_reference_bit_for_bit(moment_dtype, grad_dtype, coef):
    """Every operation rounded on its own (no contraction into fused multiply-adds): the kernel and its torch
    twin, on the same GPU, give the same bits for masters, moments and weights."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n = 10_000
    masters, moments = _two_states(g, n, moment_dtype)
    weights = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    grad_coef = None if coef is None else torch.tensor(coef, device="cuda")
    for step in range(1, 6):
        grad = torch.randn(n, device="cuda", generator=g).to(grad_dtype)
        for fn, w, (m, v), out in zip((fused_adamw.adamw_step_, fused_adamw.reference_step_), masters, moments, weights):
            fn(w, grad, m, v, out, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, step=step,
               grad_coef=grad_coef)
    assert torch.equal(masters[0], masters[1])
    for a, b in ((moments[0][0], moments[1][0]), (moments[0][1], moments[1][1]), (weights[0], weights[1])):
        assert torch.equal(a, b)


@pytest.mark.gpu
@NEEDS_TRITON_GPU
def test_gpu_kernel_reads_bf16_gradients_as_their_fp32_values():
    g = torch.Generator(device="cuda").manual_seed(1)
    n = 10_000
    masters, moments = _two_states(g, n, torch.float32)
    coef = torch.tensor(0.5, device="cuda")
    for step in range(1, 4):
        grad = torch.randn(n, device="cuda", generator=g).bfloat16()
        for w, (m, v), gr in zip(masters, moments, (grad, grad.float())):
            fused_adamw.adamw_step_(w, gr, m, v, None, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                                    step=step, grad_coef=coef)
    assert torch.equal(masters[0], masters[1])
    assert torch.equal(moments[0][0], moments[1][0]) and torch.equal(moments[0][1], moments[1][1])
