"""Expert parallelism (with data, tensor/sequence and context parallelism) equals the one-process MoE layer.

For each layout the data-parallel ranks run one micro-batch each; the one-process
reference runs the same micro-batches one after another (router losses weighted
1 / micro-batches). Compared: every rank's output, every canonical gradient after the
real gradient reduction (expert weights over the expert-data-parallel group), the
logged router losses and expert load, and the expert bias after its update.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.layers.moe import MoELayer, MoETrainingHooks
from meshtron.optim.factory import build_optimization
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.sharding import gather_canonical, initialize_parameters
from tests.distributed.launch import run_distributed

H, S, B = 32, 8, 2
SEED = 21


def cfg_a() -> ModelConfig:
    """Softmax top-2, batch aux loss, z-loss, expert bias, a shared expert."""
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64, seq_length=S,
                       normalization="RMSNorm", swiglu=True, disable_bias_linear=True, hidden_dropout=0.0,
                       attention_dropout=0.0, num_experts=8, moe_ffn_hidden_size=16, moe_router_topk=2,
                       moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01, moe_router_enable_expert_bias=True,
                       moe_router_bias_update_rate=0.01, moe_shared_expert_intermediate_size=32)


def cfg_b() -> ModelConfig:
    """Sigmoid top-3, per-sequence aux loss, GeLU experts with biases."""
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, ffn_hidden_size=64, seq_length=S,
                       swiglu=False, disable_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                       num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=3, moe_router_score_function="sigmoid",
                       moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.2)


def cfg_c() -> ModelConfig:
    """cfg_b with capacity dropping and every expert's input padded to its capacity (static all-to-all)."""
    cfg = cfg_b()
    cfg.moe_expert_capacity_factor, cfg.moe_pad_expert_input_to_capacity = 0.75, True
    return cfg


def cfg_d() -> ModelConfig:
    """cfg_a (SwiGLU experts, weighing their rows inside the activation) with capacity dropping."""
    cfg = cfg_a()
    cfg.moe_expert_capacity_factor = 0.75
    return cfg


def cfg_e() -> ModelConfig:
    """cfg_d with every expert's input padded to its capacity."""
    cfg = cfg_d()
    cfg.moe_pad_expert_input_to_capacity = True
    return cfg


#: (name, config, TP, CP, EP, sequence parallel[, grouped GEMM]) on 4 processes (DP = 4 / (TP x CP)).
LAYOUTS = [
    ("ep2-dp4", cfg_a, 1, 1, 2, False),
    ("ep4-dp4", cfg_b, 1, 1, 4, False),
    ("ep2-tp2", cfg_a, 2, 1, 2, False),
    ("ep2-tp2-sp", cfg_b, 2, 1, 2, True),
    ("ep2-cp2", cfg_b, 1, 2, 2, False),
    ("ep4-cp2", cfg_a, 1, 2, 4, False),
    # Capacity is counted per micro-batch, as in the reference (not with CP, which splits a micro-batch).
    ("ep2-dp4-capacity-padded", cfg_c, 1, 1, 2, False),
    ("ep2-tp2-sp-capacity-padded", cfg_c, 2, 1, 2, True),
    # Every expert local (EP = 1) through the grouped GEMM: the routing weights inside the SwiGLU activation,
    # whose gradients are partial sums over TP (against the reference's expert loop and weighted combine).
    ("tp2-grouped-weighted", cfg_a, 2, 1, 1, False, True),
    ("tp2-sp-grouped-weighted", cfg_a, 2, 1, 1, True, True),
    # Through the dispatcher with the grouped GEMM: SwiGLU fused with the down projection, weights 1.
    ("ep2-tp2-grouped", cfg_a, 2, 1, 2, False, True),
    # SwiGLU experts weighing the dispatched rows' weights, with dropped and with capacity-padded rows.
    ("ep2-dp4-swiglu-capacity", cfg_d, 1, 1, 2, False),
    ("ep2-tp2-swiglu-capacity-padded", cfg_e, 2, 1, 2, False, True),
]


def data(dp: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and output weights of ``dp`` micro-batches, [dp, S, B, H] each."""
    g = torch.Generator().manual_seed(3)
    return torch.randn(dp, S, B, H, generator=g).to(device), torch.randn(dp, S, B, H, generator=g).to(device)


def build_layer(cfg: ModelConfig, ctx: ParallelContext, sp: bool, grouped: Optional[bool] = None) -> MoELayer:
    with torch.device("meta"):
        layer = MoELayer(cfg, ctx, 0, sp, grouped_gemm=grouped)
    initialize_parameters(layer, SEED, ctx.device, torch.float32)
    return layer


def optim_config(tp: int, cp: int, ep: int) -> MeshtronConfig:
    full = MeshtronConfig()
    p = full.parallel
    p.tensor_model_parallel_size, p.context_parallel_size, p.expert_model_parallel_size = tp, cp, ep
    return full


def run_layout(cfg: ModelConfig, ctx: ParallelContext, sp: bool, grouped: Optional[bool] = None):
    """One micro-batch per data-parallel rank: outputs, canonical grads, metrics, expert bias."""
    layer = build_layer(cfg, ctx, sp, grouped)
    layer.train()
    optim = build_optimization(optim_config(ctx.tp, ctx.cp, ctx.ep), ctx, [layer])
    hooks = MoETrainingHooks([layer], ctx, 1, cfg)
    xs, rs = data(ctx.dp, ctx.device)
    x, r = xs[ctx.dp_rank], rs[ctx.dp_rank]
    chunk = S // ctx.cp  # this context-parallel rank's positions
    x, r = x[ctx.cp_rank * chunk:(ctx.cp_rank + 1) * chunk], r[ctx.cp_rank * chunk:(ctx.cp_rank + 1) * chunk]
    if layer.sequence_parallel:
        part = x.shape[0] // ctx.tp
        x, r = x[ctx.tp_rank * part:(ctx.tp_rank + 1) * part], r[ctx.tp_rank * part:(ctx.tp_rank + 1) * part]
    optim.grad_buffer.zero()
    y = layer(x)
    (y * r).sum().backward()
    optim.grad_sync.finish()
    grads = gather_canonical([layer], "grad")
    metrics = hooks.metrics()
    hooks.after_step(True)
    bias = layer.router.expert_bias.clone() if layer.router.expert_bias is not None else None
    return y.detach().cpu(), grads, metrics, bias.cpu() if bias is not None else None


def reference(cfg: ModelConfig, dp: int, device: torch.device = torch.device("cpu")):
    ctx = ParallelContext(device=device)
    layer = build_layer(cfg, ctx, False)
    layer.train()
    hooks = MoETrainingHooks([layer], ctx, dp, cfg)
    xs, rs = data(dp, device)
    ys = []
    for x, r in zip(xs, rs):
        y = layer(x)
        (y * r).sum().backward()
        ys.append(y.detach())
    grads = gather_canonical([layer], "grad")
    metrics = hooks.metrics()
    hooks.after_step(True)
    bias = layer.router.expert_bias.cpu() if layer.router.expert_bias is not None else None
    return torch.stack(ys).cpu(), grads, metrics, bias


def layouts_worker(rank: int, world: int, layouts, device: torch.device = torch.device("cpu")):
    out = []
    for _, make_cfg, tp, cp, ep, sp, *grouped in layouts:
        ctx = build_groups(tp, cp, 1, ep, device)
        y, grads, metrics, bias = run_layout(make_cfg(), ctx, sp, grouped[0] if grouped else None)
        coords = (ctx.dp_rank, ctx.cp_rank, ctx.tp_rank, ctx.ep_rank, ctx.expert_dp_rank)
        out.append((coords, y, grads if rank == 0 else None, metrics, bias))
    return out


def check_layouts(results: list, layouts: list, world: int, device: torch.device = torch.device("cpu")) -> None:
    """Every rank's results of :func:`layouts_worker` equal the one-process reference."""
    for i, (name, make_cfg, tp, cp, ep, sp, *_) in enumerate(layouts):
        dp = world // (tp * cp)
        ref_cfg = make_cfg()
        ref_cfg.moe_pad_expert_input_to_capacity = False  # padded layouts must equal the plain dispatch
        ref_y, ref_grads, ref_metrics, ref_bias = reference(ref_cfg, dp, device)
        seen_expert_dp = set()
        for rank, per_layout in enumerate(results):
            (dp_rank, cp_rank, tp_rank, ep_rank, edp_rank), y, grads, metrics, bias = per_layout[i]
            seen_expert_dp.add(edp_rank)
            want = ref_y[dp_rank]
            chunk = S // cp
            want = want[cp_rank * chunk:(cp_rank + 1) * chunk]
            if sp:
                part = want.shape[0] // tp
                want = want[tp_rank * part:(tp_rank + 1) * part]
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} rank {rank}: {m}")
            assert metrics.keys() == ref_metrics.keys()
            for key in ref_metrics:
                assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5), f"{name} rank {rank} {key}"
            if ref_bias is not None:
                torch.testing.assert_close(bias, ref_bias, rtol=0, atol=1e-7)
            if grads is not None:
                assert grads.keys() == ref_grads.keys(), name
                for key in ref_grads:
                    torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-5, atol=1e-6,
                                               msg=lambda m: f"{name} {key}: {m}")
        assert len(seen_expert_dp) == dp * cp // ep, name
        assert ref_metrics["aux_loss"] > 0


def test_expert_parallel_layouts_equal_one_process():
    check_layouts(run_distributed(layouts_worker, 4, LAYOUTS, timeout=300), LAYOUTS, 4)
