"""The training loop: build everything from the config, then iterate.

One iteration = one global batch: this rank's micro-batches run forward and
backward (the pipeline schedule decides the order), gradients accumulate in fp32
buffers, are reduced over the groups that share parameters, clipped by the
global norm, and AdamW steps the fp32 masters.

The loss of a micro-batch is sum(token_loss * loss_mask) / (loss tokens in the
whole global batch), so the gradients summed over micro-batches and data-parallel
ranks are those of the global-batch mean loss, whatever the layout. That is what
makes every layout train the same model (DESIGN.md section 4).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from meshtron import checkpoint
from meshtron.build import build_model_chunks, gpt_forward_step
from meshtron.config import MeshtronConfig
from meshtron.emulation.trace import recording
from meshtron.layers.moe import MoETrainingHooks
from meshtron.layers.mtp import MTPMetrics, add_mtp_inputs, mtp_depths, mtp_valid_positions, weigh_mtp_loss
from meshtron.memory_report import record_memory
from meshtron.optim.clip import clip_coefficient
from meshtron.optim.factory import build_optimization, weights_norm
from meshtron.optim.lr_schedule import learning_rate
from meshtron.parallel.context import ParallelContext, context_from_config
from meshtron.parallel.context_parallel.split import split_micro_batch
from meshtron.parallel.random import RNGTracker, capture_rng_state, restore_rng_state
from meshtron.pipeline import get_schedule, is_data_rank
from meshtron.pipeline.batches import broadcast_from_loss_stage, eval_batches, train_batches
from meshtron.pipeline.balance import pipeline_balance_hint
from meshtron.resilience.faults import FaultInjector
from meshtron.resilience.hang import Progress, enable_nccl_flight_recorder, hang_watchdog, report_directory
from meshtron.resilience.rerun import RerunGuard, local_nonfinite, nonfinite_on_any_rank
from meshtron.resilience.restart import restart_count, restart_event, resume_candidates
from meshtron.resilience.straggler import StragglerDetector
from meshtron.resilience.weight_hash import WeightHashCheck, mismatch_message
from meshtron.run_layout import RunLayout, resolve_layout, shards_gradients
from meshtron.training.gc_control import ManualGC
from meshtron.training.metrics import compute_throughput, flops_per_token, peak_memory_stats, peak_tflops
from meshtron.training.step_profiler import StepProfiler
from meshtron.training.state import TrainingState
from meshtron.validation import validate_run


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. repeated non-finite losses); the message says why."""


@dataclass
class TrainingResult:
    """What a finished run reports (used by tests and `meshtron bench`)."""

    train_losses: dict = field(default_factory=dict)  # iteration -> global-batch mean loss
    eval_losses: dict = field(default_factory=dict)  # iteration -> validation loss
    test_losses: dict = field(default_factory=dict)  # iteration -> test-split loss (at the end of a run)
    grad_norms: dict = field(default_factory=dict)
    step_times: dict = field(default_factory=dict)
    final_iteration: int = 0
    sample: Optional[str] = None


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a :class:`~meshtron.run_layout.RunLayout`'s ``compute_dtype`` name."""
    return getattr(torch, name)


def _to_device(mb: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in mb.items()}


def device_label(device: torch.device) -> str:
    """What the console's per-device rates are per: "GPU" on CUDA, else the device kind ("CPU")."""
    return "GPU" if device.type == "cuda" else device.type.upper()


class Trainer:
    """Owns the model, optimizer, data and logging of one run on this rank."""

    def __init__(self, cfg: MeshtronConfig, ctx: ParallelContext, data=None, layout: Optional[RunLayout] = None):
        from meshtron.data import build_data
        from meshtron.training.logging_sinks import TrainingLogger

        self.cfg, self.ctx = cfg, ctx
        # What the configuration implies about the layout: resolved once by run_training (or here, for a caller
        # that built its own process groups).
        self.layout = layout if layout is not None else resolve_layout(cfg, ctx.world_size)
        _check_loss_stage(ctx, self.layout)
        self.device = ctx.device
        self.dtype = torch_dtype(self.layout.compute_dtype)
        t = cfg.train
        self.num_micro_batches = t.global_batch_size // (t.micro_batch_size * ctx.dp)
        self.logger = TrainingLogger(cfg.log, ctx.is_logging_rank, t.train_iters,
                                     device_label=device_label(self.device))
        self.reads_data = is_data_rank(ctx, cfg)  # middle pipeline stages read no data
        self.data = data if data is not None else build_data(cfg, ctx.dp_rank, ctx.dp,
                                                             is_data_rank=self.reads_data)
        self.vocab_size = self.data.vocab_size
        self.tracker = RNGTracker(t.seed, ctx.tp_rank, ctx.pp_rank, self.device)
        self.tracker.seed_default()
        self.model_chunks = build_model_chunks(cfg, ctx, self.vocab_size, self.tracker, self.dtype,
                                               pipeline=self.layout.pipeline)
        self.params = [p for chunk in self.model_chunks for p in chunk.parameters()]
        self.optim = build_optimization(cfg, ctx, self.model_chunks)
        # The data-parallel strategy owns the gradients, their reduction and the weights' gather.
        self.dp_strategy, self.optimizer = self.optim.strategy, self.optim.optimizer
        # ZeRO-2/3 keep only reduced shards, and the norm sums only the parts it counts: with
        # --check-for-nan-in-loss-and-grad every rank's shard and own loss are checked as well.
        self.grads_sharded = shards_gradients(self.dp_strategy.name)
        self.check_shards = self.grads_sharded and t.check_for_nan_in_loss_and_grad
        #: Create the optimizer's state at a skipped step too (an emulated rank: its values are not the real ones
        #: and may skip every step, where the real rank creates its state at its first step).
        self.create_state_on_skipped_step = False
        self.schedule = get_schedule(cfg, ctx, gpt_forward_step, self.layout)
        # Router-loss weighting, expert-bias updates and MoE metrics (None for dense models).
        self.moe = (MoETrainingHooks(self.model_chunks, ctx, self.num_micro_batches, cfg.model)
                    if cfg.model.num_experts else None)
        # Multi-token prediction: its inputs are added to training micro-batches, its loss logged apart.
        self.mtp_depths = mtp_depths(cfg.model)
        self.mtp = MTPMetrics(self.model_chunks, ctx, self.mtp_depths) if self.mtp_depths else None
        self.state = TrainingState()
        self.result = TrainingResult()
        self.params_norm = weights_norm(self.model_chunks, ctx) if cfg.log.log_params_norm else None
        self.flops_per_token = flops_per_token(cfg.model, self.vocab_size)
        self.peak_tflops = peak_tflops(self.device, cfg.log.peak_tflops)
        # Where this rank is (plain attribute stores read by the hang watchdog) and the drills' faults.
        self.progress = Progress()
        self.faults = FaultInjector.from_config(cfg, ctx.rank)  # None without --inject-fault
        p2p = getattr(self.schedule, "keywords", {}).get("p2p")
        if p2p is not None:  # the pipeline's sends and receives, counted for the hang report
            p2p.ledger = self.progress.p2p
            if self.faults is not None:
                self.progress.p2p.before_send = lambda: self.faults.hang_before_send(self.progress.iteration)
        # Straggler timing, NaN/spike re-runs and the weight-hash check: each None when off.
        self.straggler = StragglerDetector.from_config(cfg, ctx)
        self.rerun = RerunGuard.from_config(cfg, ctx, self.tracker, self.model_chunks)
        self.weight_hash = WeightHashCheck.from_config(cfg, ctx, self.model_chunks)
        self._weights_checked_at = -1
        self._skip_explained = False  # the re-run guard already logged why this step was skipped
        self._first_skipped: Optional[int] = None  # this process's first skipped (non-finite) iteration
        self._weights_finite_at = -1  # the iteration whose weights were last found finite

    def close(self) -> None:
        """Release the hooks that keep this run's parameters and buffers alive after it ends."""
        self.optim.close()

    # ----------------------------------------------------------------------------------- steps
    def _prepare(self, micro_batches: list[dict]) -> list[dict]:
        """Move micro-batches to the device, keep this CP rank's part of the sequence, and attach each
        token's loss weight (mask / loss tokens of the whole global batch, over DP x CP)."""
        return self._weigh_loss(self._to_rank(micro_batches))

    def _to_rank(self, micro_batches: list[dict], training: bool = False) -> list[dict]:
        """The micro-batches on the device, cut to this CP rank's part of the sequence. ``training``: with
        the multi-token prediction inputs, built from the whole sequence before the cut."""
        depths = self.mtp_depths if training else 0
        return [split_micro_batch(add_mtp_inputs(_to_device(mb, self.device), depths), self.ctx.cp, self.ctx.cp_rank)
                for mb in micro_batches]

    def _weigh_loss(self, mbs: list[dict]) -> list[dict]:
        """Replace each loss mask by token weights: mask / loss tokens of the global batch (one all-reduce)."""
        if not mbs or "loss_mask" not in mbs[0]:  # a middle pipeline stage: no data, only the count
            return mbs
        local = sum(mb["loss_mask"].sum() for mb in mbs)
        count = local.float().reshape(1)
        mtp_positions = mtp_valid_positions(mbs)  # each prediction depth's, summed in the same all-reduce
        if mtp_positions is not None:
            count = torch.cat([count, mtp_positions])
        if self.ctx.dp_cp_group is not None:
            dist.all_reduce(count, group=self.ctx.dp_cp_group)
        inv = 1.0 / count[:1].clamp(min=1.0)
        for mb in mbs:
            mb["loss_weight"] = mb.pop("loss_mask").float() * inv
        if mtp_positions is not None:
            weigh_mtp_loss(mbs, count[1:])
        return mbs

    def _reduce_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Global-batch mean loss from this rank's weighted sum (summed over DP x CP), as the pipeline
        stage with the loss computed it, on every rank."""
        loss = loss_sum.float().clone().reshape(1)
        if self.ctx.dp_cp_group is not None:
            dist.all_reduce(loss, group=self.ctx.dp_cp_group)
        return broadcast_from_loss_stage(loss, self.ctx)

    def _lap(self, section: str, last: bool = False) -> None:
        """Close a straggler-timing section (nothing without --log-straggler-interval)."""
        if self.straggler is not None:
            self.straggler.timer.lap(section, last)

    def _gradients(self, micro_batches: list[dict], iteration: int, attempt: int,
                   check_local: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """Forward, backward and gradient reduction of one execution of an iteration (``attempt`` 0, or a
        re-run); returns (this rank's loss sum, the global gradient norm, both on device, and with
        ``check_local`` whether this rank's own loss or gradients were non-finite before the reduction)."""
        self.dp_strategy.zero()
        mbs = self._to_rank(micro_batches, training=True)
        self._lap("data")
        if self.faults is not None:
            self.faults.hang_point(iteration)
        mbs = self._weigh_loss(mbs)
        self._lap("communication")
        self.progress.phase = "forward-backward"
        # A checked re-run does not overlap the reduction with the backward pass, so that this rank's
        # own gradients can be read before they are summed.
        overlap = None if check_local else self.dp_strategy.start_overlap
        loss_sum = self.schedule(self.model_chunks, mbs, on_chunk_grads_ready=overlap)
        if self.faults is not None:
            loss_sum = self.faults.corrupt_loss(iteration, attempt, loss_sum)
            if not self.grads_sharded:
                self.faults.corrupt_grads(iteration, attempt, self.dp_strategy.gradient_tensors())
        local_bad = None
        if check_local:
            # Strategies that reduce gradients as they arrive have no unreduced ones: the loss is checked.
            local_bad = local_nonfinite(loss_sum, self.dp_strategy.local_gradients() or [])
        self._lap("forward_backward")
        self.progress.phase = "gradient-sync"
        self.dp_strategy.finish()
        if self.faults is not None and self.grads_sharded:
            # Into the reduced shard: written before finish(), the drill's NaN would be overwritten by
            # the reductions still in flight.
            self.faults.corrupt_grads(iteration, attempt, self.dp_strategy.gradient_tensors())
        self._lap("communication")
        norm = self.optim.grad_norm()
        if self.check_shards:
            # A NaN/inf in any rank's gradient shard or own loss makes the step's gradient non-finite, also
            # where the norm does not count it: the norm is then NaN on every rank, so every rank skips or
            # re-runs the step alike (no host sync here; it is read with the norm).
            bad = nonfinite_on_any_rank([loss_sum.reshape(1), *self.dp_strategy.gradient_tensors()], self.ctx)
            norm = torch.where(bad > 0, torch.full_like(norm, float("nan")), norm)
        return loss_sum, norm, local_bad

    def _synced(self, norm: torch.Tensor, loss_sum: torch.Tensor) -> list[float]:
        """The step's one host sync: [grad norm], or [grad norm, global loss] when the re-run guard
        judges the loss (then the loss is reduced every step, and read in the same transfer)."""
        if self.rerun is None or not self.rerun.needs_loss:
            return [norm.item()]
        return torch.cat([norm.float().reshape(1), self._reduce_loss(loss_sum)]).tolist()

    def learning_rate(self, iteration: int, applied: Optional[bool] = None) -> float:
        """The learning rate of iteration ``iteration``: Megatron-LM's schedule, whose position advances by the
        global batch only with applied steps. ``applied`` is given once the iteration has been counted (its own
        skip is then not one that came before it)."""
        t = self.cfg.train
        skipped = self.state.skipped_iterations - (1 if applied is False else 0)
        return learning_rate(self.cfg.optim, iteration, t.train_iters, t.global_batch_size or 1,
                             skipped_iterations=skipped, train_samples=t.train_samples)

    def train_step(self, micro_batches: list[dict], iteration: int) -> tuple[torch.Tensor, float, bool]:
        """One iteration; returns (this rank's loss sum, grad norm, whether the step was applied)."""
        for chunk in self.model_chunks:
            chunk.train()
        if self.straggler is not None and not self.straggler.timer.open:
            self.straggler.timer.start()  # a caller outside the training loop (meshtron bench)
        if self.rerun is not None:
            self.rerun.capture()
        self._skip_explained = False
        loss_sum, norm, _ = self._gradients(micro_batches, iteration, attempt=0)
        values = self._synced(norm, loss_sum)
        applied = all(math.isfinite(v) for v in values)
        if self.rerun is not None:
            verdict = self.rerun.judge(values)
            if not verdict.ok or self.rerun.always_rerun:
                loss_sum, norm, values, applied = self._rerun(micro_batches, iteration, loss_sum, values, verdict)
            elif applied:
                self.rerun.accept(values)
        if applied:
            # The optimizer applies the clipping coefficient as it reads the gradients (no extra pass).
            coef = clip_coefficient(norm, self.cfg.optim.clip_grad) if self.cfg.optim.clip_grad > 0 else None
            self.progress.phase = "optimizer"
            self.optimizer.step(self.learning_rate(iteration), grad_coef=coef)
            if self.faults is not None:
                self.faults.after_optimizer_step(iteration, self.params)
        elif self.create_state_on_skipped_step:
            self.optimizer.ensure_state()
        self._lap("optimizer", last=True)
        if self.moe is not None:
            self.moe.after_step(applied)
        return loss_sum, values[0], applied

    def _rerun(self, micro_batches: list[dict], iteration: int, loss_sum: torch.Tensor, values: list[float],
               verdict) -> tuple[torch.Tensor, torch.Tensor, list[float], bool]:
        """Execute the iteration again from the state before it (no step was applied); returns the
        (loss sum, norm, synced values) to keep and whether to apply the step. Raises TrainingError
        for a persistent fault with --rerun-persistent-action stop."""
        guard = self.rerun
        first_loss_bad = ~torch.isfinite(loss_sum.detach().float()).all()
        guard.restore()
        if not verdict.ok:
            self.dp_strategy.clear_gradients()  # no NaN of the first execution stays behind (e.g. in padding)
        loss2, norm2, local_bad = self._gradients(micro_batches, iteration, attempt=1, check_local=not verdict.ok)
        values2 = self._synced(norm2, loss2)
        second = guard.judge(values2)
        if guard.stats is not None:
            guard.stats.add(values, values2)
        if verdict.ok:  # report_stats on a healthy step: keep the second execution if it is healthy too
            if second.ok:
                guard.accept(values2)
            else:
                self.logger.warning(f"iteration {iteration}: the second execution (--rerun-mode report_stats) "
                                    f"failed a check ({second.detail}); step skipped")
                self._skip_explained = True
            return loss2, norm2, values2, second.ok
        outcome = guard.conclude(iteration, verdict, second, first_loss_bad, local_bad, loss_sum)
        self.logger.log_event(outcome.event())
        if outcome.action == "stopped":
            raise TrainingError(outcome.message() + " (--rerun-persistent-action stop)")
        self.logger.warning(outcome.message())
        self._skip_explained = True
        if outcome.action == "continued":
            guard.accept(values2)
            return loss2, norm2, values2, True
        return loss2, norm2, values2, False

    @torch.no_grad()
    def evaluate(self, split: str = "valid", iteration: Optional[int] = None) -> Optional[float]:
        """The mean loss over --eval-iters batches of ``split`` ("valid" or "test"), on every rank; None
        without that split. ``iteration``: the training iteration it follows (where Megatron's data order
        continues validation)."""
        batches = eval_batches(self.data, self.ctx, self.reads_data, self.num_micro_batches, split=split,
                               iteration=iteration)
        if batches is None:
            return None
        for chunk in self.model_chunks:
            chunk.eval()
        total, n = None, 0
        for micro_batches in batches:
            self.progress.beats += 1  # evaluation may outlast the hang timeout: each batch is progress
            mbs = self._prepare(micro_batches)
            loss_sum = self.schedule(self.model_chunks, mbs, forward_only=True)
            total = loss_sum if total is None else total + loss_sum
            n += 1
        if n == 0:
            return None
        return self._reduce_loss(total).item() / n

    # ----------------------------------------------------------------------------------- loop
    def load(self) -> None:
        """Resume from a checkpoint: ``--load``, and on an automatic restart first ``--save``."""
        ck = self.cfg.checkpoint
        attempt = restart_count()
        candidates = resume_candidates(ck.load, ck.save, attempt)
        loaded = False
        for directory, is_user_load in candidates:
            loaded = self._load_from(directory, finetune=is_user_load and ck.finetune)
            if loaded:
                break
        if not loaded and ck.load and ck.exit_on_missing_checkpoint:
            raise TrainingError(f"--load {ck.load}: no checkpoint there, and --exit-on-missing-checkpoint "
                                f"forbids starting from scratch")
        if candidates and not loaded:
            self.logger.info(f"no checkpoint in {' or '.join(d for d, _ in candidates)}; starting from scratch")
        if attempt > 0:
            self.logger.info(f"restart attempt {attempt}: resuming at iteration {self.state.iteration}")
            self.logger.log_event(restart_event(attempt, self.state.iteration))

    def _load_from(self, directory: str, finetune: bool) -> bool:
        """Load the latest checkpoint in ``directory``; False when there is none."""
        ck = self.cfg.checkpoint
        self.progress.phase = "checkpoint"
        state = checkpoint.load_checkpoint(directory, self.model_chunks, self.optimizer,
                                     self.ctx, self.cfg, load_optim=not ck.no_load_optim,
                                     load_rng=not ck.no_load_rng)
        if state is None:
            return False
        if finetune:
            state = TrainingState()
        elif state.rng is not None and not ck.no_load_rng:
            restore_rng_state(state.rng, self.tracker)
        self.state = state
        self.logger.resume_at(state.iteration)
        self.logger.info(f"resumed from {directory} at iteration {state.iteration}")
        return True

    def save(self) -> None:
        ck = self.cfg.checkpoint
        if not ck.save:
            return
        if self.weight_hash is not None:  # never save weights that the replicas disagree on
            self._check_weight_hash(self.state.iteration)
        self._check_weights_finite(self.state.iteration)  # nor NaN/inf weights over the last good checkpoint
        self.progress.phase = "checkpoint"
        self.state.rng = capture_rng_state(self.tracker)
        self._finish_param_gather(whole=False)  # save_checkpoint reads ZeRO-3 weights from their shards
        checkpoint.save_checkpoint(ck.save, self.state, self.model_chunks, None if ck.no_save_optim else self.optimizer,
                             self.ctx, self.cfg, tokenizer=self.data.tokenizer, async_save=ck.async_save,
                             retain=ck.save_retain, save_rng=not ck.no_save_rng, report=self.logger.info)

    def _log_record(self, iteration: int, loss: float, norm: float, lr: float, step_time: float) -> dict:
        tokens = self.cfg.train.global_batch_size * self.cfg.model.seq_length
        speed = compute_throughput(tokens, self.ctx.world_size, step_time, self.flops_per_token, self.peak_tflops)
        return {"type": "train", "iteration": iteration, "consumed_samples": self.state.consumed_samples,
                "consumed_tokens": self.state.consumed_samples * self.cfg.model.seq_length,
                "loss": loss, "lr": lr, "grad_norm": norm, "step_time_s": step_time,
                "tokens_per_sec_per_gpu": speed.tokens_per_sec_per_gpu, "tflops_per_gpu": speed.tflops_per_gpu,
                "mfu": speed.mfu, **peak_memory_stats(self.device), **self._optional_norms()}

    def _finish_param_gather(self, whole: bool = True) -> None:
        """Complete the weights before reading them outside a forward pass: with --overlap-param-gather
        the last step's all-gathers may still be in flight. ``whole`` False: a reader of ZeRO-3's own weight
        shards only waits for gathers in flight (the full weights are not gathered)."""
        from meshtron.checkpoint.owned import first_weight_gather_done, sharded_weights

        if not whole and sharded_weights(self.optimizer) is not None:
            first_weight_gather_done(self.optimizer)
        else:
            self.optimizer.finish_param_gather()

    def _optional_norms(self) -> dict:
        """--log-params-norm and --log-num-zeros-in-grad (collectives: every rank logs)."""
        out = {}
        if self.params_norm is not None:
            self._finish_param_gather()
            out["params_norm"] = float(self.params_norm())
        if self.cfg.log.log_num_zeros_in_grad:
            out["num_zeros_in_grad"] = int(self.optim.grad_norm.count_zeros())
        return out

    def train(self) -> TrainingResult:
        """Resume, train to --train-iters (or an exit condition) and save, watched by the hang watchdog."""
        save_lock = checkpoint.lock_save_dir(self.cfg.checkpoint.save, self.ctx)  # one job per --save directory
        watchdog = hang_watchdog(self.cfg, self.ctx, self.progress)  # None with --hang-timeout-seconds 0
        if watchdog is not None:
            watchdog.start()
        try:
            return self._train()
        finally:
            if watchdog is not None:
                watchdog.stop()
            save_lock.release()  # once a background save still in flight has finished

    def _train(self) -> TrainingResult:
        t = self.cfg.train
        self.load()
        if t.skip_train:  # evaluation only: validation, then the test split (as Megatron-LM)
            self._evaluate_and_log(self.state.iteration)
            self._evaluate_and_log(self.state.iteration, split="test")
            self._check_run_health()
            self.result.final_iteration = self.state.iteration
            return self.result
        if t.eval_interval and self.state.iteration == 0:
            self._evaluate_and_log(0)  # the starting point, so the log shows how far validation falls
        lg = self.cfg.log
        profiler = StepProfiler(lg.profile, lg.profile_step_start, lg.profile_step_end, lg.use_pytorch_profiler,
                                lg.profile_dir or lg.tensorboard_dir or "profile", self.device,
                                self.ctx.rank, lg.profile_ranks)
        if lg.record_memory_history:
            record_memory(True)
        signal_handler = checkpoint.install_signal_handler() if t.exit_signal_handler else None
        with ManualGC(t.manual_gc, t.manual_gc_interval, t.manual_gc_eval) as manual_gc:
            try:
                self._run_iterations(signal_handler, manual_gc, profiler)
            finally:
                self._close_train_batches()
                if signal_handler is not None:
                    signal_handler.restore()  # from here a signal ends the process the usual way
                profiler.stop()
                if lg.record_memory_history:
                    self._dump_memory_snapshot(lg.memory_snapshot_path)
        checkpoint.finalize_async_saves()
        self._export_megatron()
        self.result.final_iteration = self.state.iteration
        return self.result

    def _export_megatron(self) -> None:
        """--export-megatron: the last checkpoint saved to --save, converted by rank 0 while the others wait."""
        target = self.cfg.checkpoint.export_megatron
        if not target:
            return
        from pathlib import Path

        from meshtron.checkpoint.errors import CheckpointError
        from meshtron.checkpoint.megatron.export import meshtron_to_megatron
        from meshtron.checkpoint.megatron.files import iteration_dir_name

        failure = [None]
        if self.ctx.rank == 0:
            done = Path(target) / iteration_dir_name(self.state.iteration)
            notices: list[str] = []
            if done.exists():  # a finished run started again: its last checkpoint was exported before
                notices.append(f"{done} exists already; not written again")
            else:
                try:
                    path = meshtron_to_megatron(self.cfg.checkpoint.save, target,
                                                spec=self.cfg.checkpoint.transformer_impl, add_to_existing=True,
                                                notices=notices)
                except CheckpointError as err:
                    failure[0] = str(err)
                else:
                    self.logger.info(f"wrote the Megatron-LM checkpoint {path}")
            for note in notices:
                self.logger.info(f"--export-megatron: {note}")
        if self.ctx.world_size > 1:  # every rank learns whether it worked, and none waits on a failed one
            dist.broadcast_object_list(failure, src=0)
        if failure[0] is not None:
            raise CheckpointError(f"--export-megatron {target}: {failure[0]}")

    def _close_train_batches(self) -> None:
        """Stop the training data iterator and its prefetch thread (joined, so none outlives the run)."""
        batches, self._train_batches = getattr(self, "_train_batches", None), None
        close = getattr(batches, "close", None)
        if close is not None:
            close()

    def _dump_memory_snapshot(self, path: str) -> None:
        """Write the allocator history recorded since training started (--record-memory-history)."""
        if self.ctx.world_size > 1:
            stem, dot, suffix = path.rpartition(".")
            path = f"{stem}_rank{self.ctx.rank}.{suffix}" if dot else f"{path}_rank{self.ctx.rank}"
        torch.cuda.memory._dump_snapshot(path)
        record_memory(False)
        self.logger.info(f"CUDA memory snapshot written to {path}")

    def _run_iterations(self, signal_handler, manual_gc: ManualGC, profiler: StepProfiler) -> None:
        """The training loop from the current iteration to --train-iters (or an exit condition)."""
        cfg, t = self.cfg, self.cfg.train
        start_time = time.monotonic()
        batches: Iterator[list[dict]] = train_batches(self.data, self.ctx, self.reads_data, self.state.iteration,
                                                      self.num_micro_batches)
        self._train_batches = batches  # closed by train() on every exit path
        interval_losses: list[torch.Tensor] = []
        interval_start = time.perf_counter()
        interval_steps = 0
        for iteration in range(self.state.iteration + 1, t.train_iters + 1):
            self.progress.iteration, self.progress.phase = iteration, "data"
            if self.straggler is not None:
                self.straggler.timer.start()
            if self.faults is not None:
                self.faults.at_iteration_start(iteration)
            micro_batches = next(batches)
            profiler.before_step(iteration)
            loss_sum, norm, applied = self.train_step(micro_batches, iteration)
            self.progress.phase, self.progress.first_iteration_done = "logging", True
            profiler.after_step(iteration)
            self.state.iteration = iteration
            self.state.consumed_samples += t.global_batch_size
            interval_steps += 1
            self.logger.advance(iteration)
            interval_losses.append(loss_sum)
            if applied:
                self.state.nonfinite_in_a_row = 0
            else:
                self.state.nonfinite_in_a_row += 1
                self.state.skipped_iterations += 1
                if self._first_skipped is None:
                    self._first_skipped = iteration
                if not self._skip_explained:
                    self.logger.warning(f"iteration {iteration}: non-finite loss or gradient norm ({norm}); "
                                        "step skipped")
                if self.state.nonfinite_in_a_row >= cfg.optim.max_nonfinite_steps:
                    raise TrainingError(
                        f"{self.state.nonfinite_in_a_row} consecutive iterations had a non-finite loss or gradient "
                        f"(last at iteration {iteration}); stopping. The last saved checkpoint is intact. "
                        "Try a lower --lr, a longer --lr-warmup-iters or --clip-grad 1.0.")
            self.result.grad_norms[iteration] = norm
            self.periodic_checks(iteration)
            if iteration % cfg.log.log_interval == 0 or iteration == t.train_iters:
                losses = self._reduce_loss(torch.stack([x.float().reshape(()) for x in interval_losses]).sum())
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                step_time = (time.perf_counter() - interval_start) / interval_steps
                mean_loss = losses.item() / interval_steps
                self.result.train_losses[iteration] = mean_loss
                self.result.step_times[iteration] = step_time
                lr = self.learning_rate(iteration, applied=applied)
                record = self._log_record(iteration, mean_loss, norm, lr, step_time)
                if self.moe is not None:  # every rank: the MoE metrics are reduced over ranks
                    record.update(self.moe.metrics())
                if self.mtp is not None:  # every rank, likewise
                    record.update(self.mtp.metrics(interval_steps))
                if self.rerun is not None and self.rerun.stats is not None:
                    record.update(self.rerun.stats.pop())
                self.logger.log_train(record)
                interval_losses, interval_steps = [], 0
                interval_start = time.perf_counter()
            if t.eval_interval and iteration % t.eval_interval == 0:
                manual_gc.around_evaluation()
                self.progress.phase = "eval"
                self._evaluate_and_log(iteration)
                manual_gc.around_evaluation()
                interval_start = time.perf_counter()
            manual_gc.after_step(iteration)
            checkpoint.poll_async_saves(self.device)  # "saved ... (durable)", or its failure, without waiting
            stop = self._should_stop(iteration, start_time, signal_handler)
            if cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0 or stop:
                self.save()
                interval_start = time.perf_counter()
            if stop:
                self.logger.info(f"exiting at iteration {iteration} ({stop})")
                break
        else:
            if t.eval_interval and self.state.iteration % t.eval_interval != 0:
                self._evaluate_and_log(self.state.iteration)
            if t.eval_interval:  # the test split once, at the end of a completed run (Megatron-LM's do_test)
                self._evaluate_and_log(self.state.iteration, split="test")
            self._check_run_health()  # before the last save: a broken model ends the run with exit code 1
            if self.state.skipped_iterations:
                self.logger.warning(f"{self.state.skipped_iterations} of {self.state.iteration} iterations were "
                                    "skipped as non-finite")
            if cfg.checkpoint.save and (not cfg.checkpoint.save_interval
                                        or self.state.iteration % cfg.checkpoint.save_interval != 0):
                self.save()

    def periodic_checks(self, iteration: int) -> None:
        """The straggler report and the weight-hash check when due (every rank: each gathers over the world)."""
        if self.straggler is not None and self.straggler.due(iteration):
            report = self.straggler.report(iteration)
            if report is not None:
                self.logger.log_event(report.event())
                if report.ranks:
                    self.logger.warning(report.message(self.straggler.threshold))
                if self.cfg.log.straggler_minmax_count:
                    self.logger.info(report.minmax_line(self.cfg.log.straggler_minmax_count))
        interval = self.cfg.train.check_weight_hash_across_dp_replicas_interval
        if self.weight_hash is not None and iteration % interval == 0:
            self._check_weight_hash(iteration)

    def _check_weight_hash(self, iteration: int) -> None:
        """Compare the data-parallel replicas' weights; TrainingError on a mismatch (nothing is saved)."""
        if self._weights_checked_at == iteration:
            return
        self._finish_param_gather()
        verdict = self.weight_hash.check(iteration)
        self._weights_checked_at = iteration
        if verdict.mismatch:
            self.logger.log_event(verdict.event())
            raise TrainingError(mismatch_message(verdict, self.cfg.train.weight_hash_mismatch == "restart"))

    def _evaluate_and_log(self, iteration: int, split: str = "valid") -> None:
        """Evaluate ``split`` and log it: an ``eval`` record for validation, a ``test`` record for the test split."""
        self.progress.phase = "eval"
        loss = self.evaluate(split, iteration)
        if loss is None:
            return
        (self.result.test_losses if split == "test" else self.result.eval_losses)[iteration] = loss
        ppl = math.exp(min(loss, 50.0))
        self.logger.log_eval({"type": "test" if split == "test" else "eval", "iteration": iteration,
                              "loss": loss, "ppl": ppl})

    def _check_run_health(self) -> None:
        """End a run whose model is broken with exit code 1 (TrainingError), in one line: the weights hold a
        NaN/inf, or the last validation or test loss is non-finite. A run that skipped a transient
        non-finite step and recovered passes."""
        iteration = self.state.iteration
        self._check_weights_finite(iteration)
        for name, losses in (("validation", self.result.eval_losses), ("test", self.result.test_losses)):
            if losses and not math.isfinite(losses[max(losses)]):
                raise TrainingError(f"the {name} loss at iteration {max(losses)} is {losses[max(losses)]}, "
                                    f"although the weights are finite{self._skipped_note()}; the trained model is "
                                    "not usable")

    def _check_weights_finite(self, iteration: int) -> None:
        """TrainingError when any rank's weights hold a NaN/inf (a collective: every rank calls it)."""
        if self._weights_finite_at == iteration:
            return
        self._finish_param_gather(whole=False)
        weights = self.dp_strategy.param_data  # what the optimizer writes: flat weights or this rank's shard
        tensors = [weights] if weights is not None else [p.detach() for p in self.params]
        bad = nonfinite_on_any_rank(tensors, self.ctx)
        if bad.item():
            raise TrainingError(f"the model's weights hold NaN/inf values at iteration {iteration}"
                                f"{self._skipped_note()}; the run failed and these weights are not saved. Try a "
                                "lower --lr, a longer --lr-warmup-iters or --clip-grad 1.0.")
        self._weights_finite_at = iteration

    def _skipped_note(self) -> str:
        """How many iterations were skipped as non-finite (nothing when none were)."""
        skipped = self.state.skipped_iterations
        if not skipped:
            return ""
        first = f", the first at iteration {self._first_skipped}" if self._first_skipped is not None else ""
        return f" ({skipped} of {self.state.iteration} iterations were skipped as non-finite{first})"

    def _should_stop(self, iteration: int, start_time: float, signal_handler) -> Optional[str]:
        t = self.cfg.train
        reasons = []
        if signal_handler is not None and signal_handler.triggered:
            reasons.append("SIGTERM received")
        if t.exit_interval and iteration % t.exit_interval == 0:
            reasons.append(f"--exit-interval {t.exit_interval}")
        if t.exit_duration_in_mins is not None:
            elapsed = torch.tensor([(time.monotonic() - start_time) / 60.0 >= t.exit_duration_in_mins],
                                   dtype=torch.int32, device=self.device)
            if dist.is_initialized():  # every rank must agree, or the save would hang
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if elapsed.item():
                reasons.append(f"--exit-duration-in-mins {t.exit_duration_in_mins}")
        if signal_handler is not None and dist.is_initialized():
            flag = torch.tensor([int(signal_handler.triggered)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and "SIGTERM received" not in reasons:
                reasons.append("SIGTERM received")
        return ", ".join(reasons) or None

    def sample_text(self, prompt: str = "def ", max_new_tokens: int = 48) -> Optional[str]:
        """A sample from the trained model (one-device runs with a tokenizer only)."""
        if self.data.tokenizer is None or self.ctx.world_size > 1:
            return None
        from meshtron.generate import generate_text

        return generate_text(self.model_chunks[0], self.data.tokenizer, prompt, max_new_tokens=max_new_tokens,
                             temperature=0.8, top_k=40, seed=self.cfg.train.seed)


def _check_loss_stage(ctx: ParallelContext, layout: RunLayout) -> None:
    """The process groups were built with the loss on the stage the schedule puts it (ZBV: the first)."""
    if ctx.pp > 1 and ctx.loss_stage % ctx.pp != layout.loss_stage % ctx.pp:
        raise ValueError(f"the process groups put the loss on pipeline stage {ctx.loss_stage % ctx.pp}, but the "
                         f"schedule puts it on stage {layout.loss_stage}: build them with "
                         f"context_from_config(cfg, layout)")


def run_training(cfg: MeshtronConfig, layout: Optional[RunLayout] = None) -> TrainingResult:
    """Entry point of `meshtron train`: set up the process groups, train, clean up.

    ``layout``: the :class:`~meshtron.run_layout.RunLayout` of a configuration already validated for this world
    (``meshtron train`` validates before it calls this); without it, ``cfg`` is validated here first.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if layout is None:
        layout = validate_run(cfg, world)
    if (cfg.parallel.distributed_backend or ("nccl" if cfg.train.device == "cuda" else "gloo")) == "nccl":
        enable_nccl_flight_recorder(report_directory(cfg.checkpoint.save, cfg.log.metrics_file))
    ctx = context_from_config(cfg, layout)
    # --record-collectives: every operation from the model's build on; the trainer then says where it is.
    with recording(ctx, cfg.log.record_collectives) as recorder:
        trainer = Trainer(cfg, ctx, layout=layout)
        if recorder is not None:
            recorder.where = lambda: (trainer.progress.iteration, trainer.progress.phase)
        return _run_trainer(cfg, ctx, trainer)


def _run_trainer(cfg: MeshtronConfig, ctx: ParallelContext, trainer: Trainer) -> TrainingResult:
    """Train with ``trainer`` (built by :func:`run_training`), then the sample and clean-up."""
    trainer.logger.info(f"meshtron: {ctx.describe()} on {ctx.device.type}, "
                        f"{sum(p.numel() for p in trainer.params):,} parameters on this rank, "
                        f"{trainer.num_micro_batches} micro-batches of {cfg.train.micro_batch_size} per iteration")
    hint = pipeline_balance_hint(cfg, trainer.vocab_size)
    if hint is not None:
        trainer.logger.info(hint)
    try:
        result = trainer.train()
        if cfg.train.generate_sample and not cfg.data.mock_data and not cfg.data.data_path:
            result.sample = trainer.sample_text()
            if result.sample is not None:
                trainer.logger.info("sample: " + result.sample)
        return result
    finally:
        trainer.close()
        trainer.logger.close()
