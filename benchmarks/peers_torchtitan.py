r"""torchtitan 0.2.2 on meshtron's MoE benchmark shapes, one GPU, for a side-by-side comparison.

Run through benchmarks/peers_side_by_side.sh (which installs the wheels below into /tmp/site first); one row
per process:

    python3 benchmarks/peers_torchtitan.py --row dsv3_width_mbs2

prints one line `PEER <row> tok/s <median> peak_GiB <max_memory_allocated> ...`.

Rows (shapes of benchmarks/deepseek_v3_width_one_gpu.yaml, qwen3_moe_one_gpu.yaml, new_families_one_gpu.yaml
and meshtron/presets.py; bf16 = torchtitan's single-GPU mixed precision, see below; seq 4096):
  dsv3_width_mbs2        torchtitan `deepseek_v3`: hidden 7168, 2 layers (1 dense 18432 + 1 MoE), 128 heads, MLA
                         q rank 1536 / kv rank 512 / nope 128 / rope 64 / v 128, 16 routed experts of 2048 top-8,
                         sigmoid scores, route norm, route scale 2.5, 1 shared expert (2048), expert bias
                         (torchtitan's aux-loss-free balancing), vocab 129,280, SDPA causal; micro batch 2.
  qwen3_30b_a3b_mbs4     torchtitan `qwen3` flavor 30B-A3B cut to 4 layers (hidden 2048, 32/4 heads of 128, qk
                         norm, 128 experts of 768 top-8, vocab 151,936, SDPA); micro batch 4.
  gpt_oss_20b_mbs1/_mbs2 torchtitan `gpt_oss` flavor 20b cut to 2 layers (hidden 2880, 64/8 heads of 64, sinks,
                         sliding window 128 on even layers, 32 experts of 2880 top-4 with biases, clamped SwiGLU,
                         vocab 201,088, FlexAttention: torchtitan supports only flex for gpt-oss); micro batch 1, 2.
  dsv3_width_fp8_experts_mbs2  the first row with torchtitan's `quantize.grouped_mm.float8` converter
                         (fqns=["experts"]: dynamic float8 rowwise scaled grouped GEMMs for the routed experts,
                         from torchao 0.18); every other layer stays bf16.
  dsv3_width_fp8_linear_mbs2   the first row with torchtitan's `quantize.linear.float8` converter, recipe
                         "rowwise", filter_fqns ["output", "auto_filter_small_kn"] (the output layer in bf16, as
                         meshtron's; torchtitan's filter of linears too small to gain); the experts stay bf16.
  dsv3_width_fp8_both_mbs2     both converters at once.

What is torchtitan's (unchanged, imported from the wheel):
  - the model classes and their args (DeepSeekV3Model/DeepSeekV3ModelArgs, Qwen3Model/Qwen3ModelArgs with the
    "30B-A3B" flavor, GptOssModel/GptOssModelArgs with the "20b" flavor's MoEArgs), `update_from_config`,
    meta-device construction under the training dtype, `to_empty` + `init_weights`;
  - its per-model parallelize function (parallelize_deepseekv3 / parallelize_qwen3 / parallelize_gptoss) with
    a JobConfig of compile.enable=True (components model + loss), activation_checkpoint.mode="none" and one
    GPU: on one GPU it applies only its per-block torch.compile (apply_compile: each TransformerBlock compiled,
    MoE blocks compiled per submodule with the routed-expert module left out, its grouped-mm function
    compiled on its own), as torchtitan does. Exception: torchtitan 0.2.2's parallelize_gptoss has no
    apply_compile call at all, so for gpt-oss the harness calls torchtitan's own apply_compile
    (models/llama4/infra/parallelize.py) after it; `--gpt-oss-as-shipped` leaves it out (blocks eager,
    only torchtitan's compiled flex_attention and loss). gpt-oss's experts have their own grouped-mm function,
    which apply_compile does not compile: they run eagerly in both cases, as in torchtitan;
  - its loss (build_cross_entropy_loss, compiled), its optimizer (build_optimizers_with_moe_load_balancing:
    fused AdamW lr 8e-4, eps 1e-8, weight decay 0.1, plus its expert-bias update hook), its LR scheduler
    (build_lr_schedulers, defaults), its gradient clipping (dist_utils.clip_grad_norm_, max_norm 1.0),
    its train context and its single-GPU mixed precision (dist_utils.maybe_enable_amp: fp32 weights and
    optimizer state, torch.autocast bf16: what torchtitan does on one GPU, where FSDP is off), its GC handler
    (gc_freq 50), its model converters for the FP8 row (build_model_converters);
  - gpt-oss's attention masks (model.get_attention_masks, "causal" mask type, so no tokenizer is needed).
What is the harness (this file):
  - random tokens (torch.randint over the vocabulary; labels = inputs shifted by one), no dataset/tokenizer;
  - a short loop that copies torchtitan's Trainer.train_step / forward_backward_step for one micro-batch per
    step (zero_grad, autocast forward, sum loss / valid tokens, del pred, backward, clip, optimizer step,
    scheduler step), timed with torch.cuda.synchronize per step; tok/s = micro batch x seq / median step time
    over the timed steps; peak = torch.cuda.max_memory_allocated over the whole run;
  - zeroing the MoE router's gate bias after init_weights (gpt-oss only: torchtitan 0.2.2 leaves it
    uninitialised after to_empty);
  - a single-rank process group (torchtitan's ParallelDims builds a device mesh even for one GPU);
  - import stubs (only for modules that are not installed): `tyro`, `datasets`, `torchdata` (and, for the
    CPU checks only, torchtitan's triton kernels module `torchtitan.models.moe.kernels` and
    `torch.utils.tensorboard` where triton / tensorboard are missing; the GPU image has both). torchtitan's
    config / data / metrics modules import them and its model packages import those modules, but nothing on
    the measured path uses them. A stub hands back inert placeholder classes (no data, no behaviour); the
    result line lists the stubs in use;
  - torchao 0.18 compatibility shim for the FP8 row: torchtitan 0.2.2's Float8GroupedMMConverter imports
    `torchao.prototype.moe_training.conversion_utils.MoETrainingConfig`, which torchao 0.18 does not have;
    its fp8 rowwise grouped-GEMM training config there is `torchao.prototype.moe_training.config.
    Float8TrainingOpConfig` (handled by the same quantize_ module swap). The harness aliases the old name
    to it if missing, so torchtitan's converter runs unchanged otherwise.

Wheels (prepare on a machine with PyPI, in the repository root; .whl/ is git-ignored):
    python3 -m pip download --no-deps -d .whl torchtitan==0.2.2
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl torchao==0.18.0          # only for the FP8 row
On the GPU machine: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD

CPU checks (no GPU): `--check-params` builds every row on the meta device and prints its parameter count;
`--check-wiring` passes a tiny model of each row through torchtitan's model converters (the FP8 row's
torchao swap, with the SM89 check lifted) and its parallelize function with compile on, without steps;
`--tiny --row R` runs two eager fp32 steps of a shrunken version of R's family on CPU (no compile; gpt-oss
forward + loss only with eager flex_attention, FlexAttention has no CPU backward; torch.histc counted in float
on CPU; the for-loop experts instead of the grouped-mm path, whose permute kernel is triton).
This file is a benchmark script; meshtron's package does not import it.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import socket
import statistics
import sys
import time
import types
import typing

# ---------------------------------------------------------------------------------------------------------
# Harness: stubs for modules torchtitan imports but the measured path never uses (only if not installed).


try:  # torch's Stateful (a base of torchtitan's BaseDataLoader) is a typing_extensions Protocol
    import typing_extensions

    _ProtocolMeta = type(typing_extensions.Protocol)
except ImportError:
    _ProtocolMeta = type(typing.Protocol)


class _StubMeta(_ProtocolMeta):
    """Placeholder classes: any public attribute is another placeholder class (usable as a base beside ABCs
    and Protocols: the metaclass derives from the protocol metaclass, itself an ABCMeta)."""

    def __getattr__(cls, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _Stub(metaclass=_StubMeta):
    _is_protocol = False

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})

    def __call__(self, *args, **kwargs):
        raise RuntimeError("peers_torchtitan: a stubbed module (%s) was called" % ",".join(STUBBED) + "")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _StubMeta(name, (_Stub,), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = set(roots)

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.roots or fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        mod.__version__ = "0.0.0-stub"
        return mod

    def exec_module(self, module):
        pass


STUBBED: list[str] = []


def install_stubs():
    roots = [n for n in ("tyro", "datasets", "torchdata") if importlib.util.find_spec(n) is None]
    if importlib.util.find_spec("triton") is None:  # CPU checks only: torchtitan's triton MoE kernels module
        roots.append("torchtitan.models.moe.kernels")
    if importlib.util.find_spec("tensorboard") is None:
        roots.append("torch.utils.tensorboard")
    roots = [r for r in roots if r not in STUBBED]
    if roots:
        STUBBED.extend(roots)
        sys.meta_path.insert(0, _StubFinder(roots))


def alias_torchao_moe_config():
    """torchtitan 0.2.2 imports MoETrainingConfig; torchao 0.18 calls it Float8TrainingOpConfig."""
    import torchao.prototype.moe_training.conversion_utils as cu

    if not hasattr(cu, "MoETrainingConfig"):
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig

        cu.MoETrainingConfig = Float8TrainingOpConfig


# ---------------------------------------------------------------------------------------------------------
# Rows.

ROWS = {
    "dsv3_width_mbs2": dict(family="deepseek_v3", mbs=2, fp8=False),
    "qwen3_30b_a3b_mbs4": dict(family="qwen3", mbs=4, fp8=False),
    "gpt_oss_20b_mbs1": dict(family="gpt_oss", mbs=1, fp8=False),
    "gpt_oss_20b_mbs2": dict(family="gpt_oss", mbs=2, fp8=False),
    "dsv3_width_fp8_experts_mbs2": dict(family="deepseek_v3", mbs=2, fp8=True),
    "dsv3_width_fp8_linear_mbs2": dict(family="deepseek_v3", mbs=2, fp8="linear"),
    "dsv3_width_fp8_both_mbs2": dict(family="deepseek_v3", mbs=2, fp8="both"),
}
SEQ = 4096
GPT_OSS_AS_SHIPPED = False  # --gpt-oss-as-shipped: parallelize_gptoss only (no per-block compile)


def model_spec(family: str, tiny: bool = False):
    """(model class, model args, parallelize fn) from torchtitan's own modules."""
    import copy

    from torchtitan.models.moe import MoEArgs

    if family == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import DeepSeekV3Model, DeepSeekV3ModelArgs, parallelize_deepseekv3

        moe = MoEArgs(num_experts=16, num_shared_experts=1, top_k=8, score_func="sigmoid", route_norm=True,
                      route_scale=2.5, score_before_experts=False, load_balance_coeff=1e-3)
        args = DeepSeekV3ModelArgs(vocab_size=129280, dim=7168, inter_dim=18432, moe_inter_dim=2048, n_layers=2,
                                   n_dense_layers=1, n_heads=128, moe_args=moe, q_lora_rank=1536, kv_lora_rank=512,
                                   qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, attn_type="sdpa",
                                   attn_mask_type="causal")
        if tiny:
            args = DeepSeekV3ModelArgs(vocab_size=512, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2,
                                       n_dense_layers=1, n_heads=4, moe_args=copy.deepcopy(moe), q_lora_rank=32,
                                       kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                       attn_type="sdpa", attn_mask_type="causal")
        return DeepSeekV3Model, args, parallelize_deepseekv3
    if family == "qwen3":
        from torchtitan.models.qwen3 import Qwen3Model, parallelize_qwen3, qwen3_args

        args = copy.deepcopy(qwen3_args["30B-A3B"])
        args.n_layers = 4
        if tiny:
            args.dim, args.n_heads, args.n_kv_heads, args.head_dim = 64, 4, 2, 16
            args.vocab_size, args.hidden_dim, args.moe_inter_dim = 512, 128, 32
        return Qwen3Model, args, parallelize_qwen3
    if family == "gpt_oss":
        from torchtitan.models.gpt_oss import GptOssModel, gptoss_configs, parallelize_gptoss

        args = copy.deepcopy(gptoss_configs["20b"])
        args.n_layers = 2
        if tiny:
            args.dim, args.moe_inter_dim, args.n_heads, args.n_kv_heads, args.head_dim = 64, 64, 4, 2, 16
            args.vocab_size, args.sliding_window_size = 512, 8
        return GptOssModel, args, parallelize_gptoss
    raise ValueError(family)


def job_config_for(row: dict, compile_: bool, seq: int, steps: int):
    from torchtitan.config import JobConfig

    jc = JobConfig()
    jc.training.seq_len = seq
    jc.training.local_batch_size = row["mbs"]
    jc.training.steps = steps
    jc.training.mixed_precision_param = "bfloat16"
    jc.compile.enable = compile_
    jc.compile.components = ["model", "loss"]
    jc.activation_checkpoint.mode = "none"
    converters = []
    if row["fp8"] in ("linear", "both"):
        # torchtitan's float8 dense linears, rowwise scaling (its torchao recipe); the output layer stays bf16 as
        # meshtron's does, and torchtitan's own auto filter skips the linears too small to gain from FP8
        converters.append("quantize.linear.float8")
        jc.quantize.linear.float8.recipe_name = "rowwise"
        jc.quantize.linear.float8.filter_fqns = ["output", "auto_filter_small_kn"]
    if row["fp8"] in (True, "both"):
        converters.append("quantize.grouped_mm.float8")
        jc.quantize.grouped_mm.float8.fqns = ["experts"]
    jc.model.converters = converters
    return jc


def init_single_rank(device_type: str):
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)


def build(row_name: str, device_type: str, compile_: bool, tiny: bool, seq: int, steps: int, meta_only=False):
    import torch
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.tools import utils

    row = ROWS[row_name]
    if row["fp8"]:
        alias_torchao_moe_config()
    model_cls, args, parallelize_fn = model_spec(row["family"], tiny=tiny)
    jc = job_config_for(row, compile_, seq, steps)
    args.update_from_config(jc)  # as Trainer: max_seq_len, grouped mm only on SM90+
    if tiny:  # CPU check: torchtitan's grouped-mm path needs its triton permute kernel; use its for-loop experts
        args.moe_args.use_grouped_mm = False
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[jc.training.dtype]):
        model = model_cls(args)
    if meta_only:
        return model, args, None, jc
    init_single_rank(device_type)
    pd = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    converters = build_model_converters(jc, pd)
    converters.convert(model)
    model.to_empty(device=device_type)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        # Harness fix: torchtitan 0.2.2's TokenChoiceTopKRouter.init_weights initialises gate.weight but not
        # gate.bias (gpt-oss has gate_bias=True), which to_empty leaves as uninitialised memory (NaN seen on
        # CPU). Zero it, as a fresh bias would be before training; no effect on speed.
        for name, mod in model.named_modules():
            if name.endswith("router.gate") and getattr(mod, "bias", None) is not None:
                mod.bias.zero_()
    model = parallelize_fn(model, pd, jc)  # one GPU: only torchtitan's per-block torch.compile
    if row["family"] == "gpt_oss" and compile_ and not GPT_OSS_AS_SHIPPED:
        # torchtitan 0.2.2's parallelize_gptoss never calls apply_compile (its blocks stay eager; only its
        # flex_attention and the loss are compiled). Per-block compile as torchtitan does for its other MoE
        # models: its own apply_compile (llama4.infra.parallelize), applied here by the harness.
        from torchtitan.models.llama4.infra.parallelize import apply_compile

        apply_compile(model, jc.compile, pd.ep_enabled)
    model.train()
    return model, args, (pd, converters), jc


def run_row(row_name: str, device_type: str, compile_: bool, tiny: bool, seq: int, warmup: int, timed: int):
    import torch
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.tools import utils

    row = ROWS[row_name]
    steps = warmup + timed
    torch.manual_seed(0)
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, args, (pd, converters), jc = build(row_name, device_type, compile_, tiny, seq, steps)
    jc.optimizer.implementation = "fused"  # torchtitan's default (fused AdamW exists on CPU too)
    optimizers = build_optimizers_with_moe_load_balancing([model], jc.optimizer, pd)
    lr_schedulers = build_lr_schedulers(optimizers, jc.lr_scheduler, jc.training.steps)
    optimizers.register_step_post_hook(lambda *a, **k: converters.post_optimizer_hook([model]))
    loss_fn = build_cross_entropy_loss(jc)
    train_context = dist_utils.get_train_context(False)
    amp = dist_utils.maybe_enable_amp(pd, jc.training.mixed_precision_param, device_type)
    gc_handler = utils.GarbageCollection(gc_freq=jc.training.gc_freq, debug=jc.training.gc_debug)
    mbs, vocab = row["mbs"], args.vocab_size
    gen = torch.Generator(device="cpu").manual_seed(1234)
    attn_type = getattr(args, "attn_type", "sdpa")
    # CPU check only: FlexAttention has no CPU backward, so gpt-oss's tiny check runs forward + loss.
    forward_only = device_type == "cpu" and attn_type == "flex"

    times, losses = [], []
    for step in range(1, steps + 1):
        gc_handler.run(step)
        tokens = torch.randint(0, vocab, (mbs, seq + 1), generator=gen)
        inputs = tokens[:, :-1].contiguous().to(device_type)
        labels = tokens[:, 1:].contiguous().to(device_type)
        if device_type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        # --- as torchtitan Trainer.train_step / forward_backward_step, one micro-batch ---
        optimizers.zero_grad()
        global_valid_tokens = torch.tensor(labels.numel(), device=device_type).float()
        extra_kwargs = {}
        if attn_type in ("flex", "varlen"):
            extra_kwargs["attention_masks"] = model.get_attention_masks(input_batch=inputs, tokenizer=None)
        with train_context():
            with amp, (torch.no_grad() if forward_only else contextlib.nullcontext()):
                pred = model(inputs, **extra_kwargs)
                loss = loss_fn(pred, labels) / global_valid_tokens
            del pred
            if not forward_only:
                loss.backward()
        if not forward_only:
            dist_utils.clip_grad_norm_([p for p in model.parameters()], jc.training.max_norm, foreach=True,
                                       pp_mesh=None, ep_enabled=False)
            optimizers.step()
            lr_schedulers.step()
        # --- end of torchtitan's step ---
        if device_type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        lv = loss.detach().item()
        losses.append(lv)
        if step == 1:
            first_step_s = dt
        if step > warmup:
            times.append(dt)
        print(f"  {row_name} step {step} {dt * 1000:.1f} ms loss {lv:.4f}", file=sys.stderr, flush=True)

    med = statistics.median(times) if times else float("nan")
    tok_s = mbs * seq / med
    peak = torch.cuda.max_memory_allocated() / 2**30 if device_type == "cuda" else float("nan")
    nparams = sum(p.numel() for p in model.parameters())
    dev = torch.cuda.get_device_name() if device_type == "cuda" else "cpu"
    print(f"PEER {row_name} tok/s {tok_s:,.0f} peak_GiB {peak:.1f} median_ms {med * 1000:.1f} "
          f"first_step_s {first_step_s:.1f} params {nparams:,} mbs {mbs} seq {seq} warmup {warmup} timed {timed} "
          f"loss_first {losses[0]:.3f} loss_last {losses[-1]:.3f} device {dev!r} "
          f"torchtitan 0.2.2 torch {torch.__version__}" + (f" stubs {','.join(STUBBED)}" if STUBBED else ""),
          flush=True)
    return tok_s, losses


def check_params():
    for name, row in ROWS.items():
        if row["fp8"]:
            continue
        model, args, _, _ = build(name, "cpu", False, False, SEQ, 1, meta_only=True)
        n = sum(p.numel() for p in model.parameters())
        print(f"PARAMS {name} {n:,}", flush=True)


def check_wiring():
    """CPU: tiny model of each family through torchtitan's converters + parallelize (compile on), no steps."""
    import torch
    import torchtitan.components.quantization.float8 as tt_float8

    tt_float8.has_cuda_capability = lambda *a: True  # CPU check only: let the FP8 converter build
    for name, row in ROWS.items():
        if name.endswith("_mbs2") and row["family"] == "gpt_oss":
            continue
        model, args, _, jc = build(name, "cpu", True, True, 64, 2)
        compiled = sum(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())
        kinds = sorted({type(p).__name__ for n, p in model.named_parameters() if "experts" in n})
        fp8_linears = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        print(f"WIRING {name} compiled_submodules {compiled} expert_param_types {kinds} float8_linears {fp8_linears}",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--row", choices=list(ROWS))
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--timed", type=int, default=12)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--check-params", action="store_true", help="CPU: meta-device parameter counts")
    ap.add_argument("--gpt-oss-as-shipped", action="store_true",
                    help="gpt-oss: torchtitan's parallelize_gptoss only, without the harness's per-block compile")
    ap.add_argument("--check-wiring", action="store_true",
                    help="CPU: tiny models through converters + parallelize (compile wrappers), no steps")
    ap.add_argument("--tiny-compile", action="store_true", help="with --tiny: torchtitan's compile on (slow on CPU)")
    ap.add_argument("--tiny", action="store_true", help="CPU: 2 eager fp32 steps of a tiny version of --row")
    a = ap.parse_args()
    install_stubs()
    import torch

    global GPT_OSS_AS_SHIPPED
    GPT_OSS_AS_SHIPPED = a.gpt_oss_as_shipped

    if a.check_params:
        check_params()
        return
    if a.check_wiring:
        check_wiring()
        return
    if a.tiny:
        torch.set_num_threads(1)
        # CPU check only: torchtitan's router counts tokens per expert with torch.histc on integer indices,
        # which CUDA supports and CPU does not; count in float there (same result).
        _histc = torch.histc

        def histc_cpu(x, *args, **kwargs):
            if x.device.type == "cpu" and not x.is_floating_point():
                return _histc(x.float(), *args, **kwargs).to(x.dtype)
            return _histc(x, *args, **kwargs)

        torch.histc = histc_cpu
        # CPU check only: torchtitan compiles flex_attention (max-autotune), which inductor cannot lower on CPU
        # with return_lse; run it eagerly there.
        from torch.nn.attention.flex_attention import flex_attention
        from torchtitan.models.attention import FlexAttentionWrapper

        FlexAttentionWrapper._compiled_flex_attn = flex_attention
        if ROWS[a.row]["fp8"]:  # CPU check only: let the FP8 converter build (its experts run the for-loop path)
            import torchtitan.components.quantization.float8 as tt_float8

            tt_float8.has_cuda_capability = lambda *args: True
        run_row(a.row, "cpu", a.tiny_compile, True, 64, 1, 1)
        return
    if not torch.cuda.is_available():
        sys.exit("peers_torchtitan: needs a GPU (use --check-params or --tiny on CPU)")
    run_row(a.row, "cuda", not a.no_compile, False, SEQ, a.warmup, a.timed)


if __name__ == "__main__":
    main()
