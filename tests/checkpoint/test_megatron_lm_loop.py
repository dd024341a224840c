"""A checkpoint saved by Megatron-LM's own training loop (not by megatron-core alone), read and continued.

``tests/fixtures/megatron/megatron_lm_loop_dense``: Megatron-LM core_v0.19.0's ``pretrain_gpt.py`` (local layers,
no Transformer Engine or Apex, the distributed optimizer, bf16, NullTokenizer ids of meshtron's default corpus) ran
2 iterations of a 2-layer model (hidden 64, grouped-query attention, SwiGLU, RoPE, untied) on one H100 and saved in
its default format, torch_dist with the optimizer's ``dp_reshardable`` buckets. Made on 2026-12-07 at commit
a983fc6 by ``bash benchmarks/pending_gpu_checks.sh migration_fixtures`` (``ONLY=fixtures`` of
benchmarks/megatron_continuation.sh, which names the flags). Beyond the megatron-core fixtures it holds what the
training loop adds: every argument of Megatron-LM's parser in ``args``, the rerun state machine, the scheduler's
state and the consumed samples, all inside the DCP files (core 0.19's common state).
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshtron.checkpoint.megatron.detect import find_megatron_checkpoint
from meshtron.checkpoint.megatron.reader import read_megatron

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "megatron" / "megatron_lm_loop_dense"


def test_megatron_lm_loop_checkpoint_reads_whole():
    state = read_megatron(find_megatron_checkpoint(FIXTURE))
    assert state.notices == []
    # 2 iterations of 16 samples; the scheduler in samples (Megatron-LM counts its steps x global batch)
    assert (state.iteration, state.step, state.consumed_samples) == (2, 2, 32)
    assert state.scheduler["num_steps"] == 32 and state.scheduler["max_lr"] == 1e-3
    assert state.args.tokenizer_type == "NullTokenizer" and state.args.transformer_impl == "local"
    assert state.settings["num_layers"] == 2 and state.settings["vocab_size"] == 2048
    assert set(state.optim) == {"master", "exp_avg", "exp_avg_sq"}
    for name, weight in state.model.items():  # bf16 weights; every fp32 master rounds to its weight
        assert weight.dtype == torch.bfloat16, name
        assert torch.equal(state.optim["master"][name].to(weight.dtype), weight), name
        assert state.optim["exp_avg_sq"][name].abs().sum() > 0, name  # two steps taken: moments are not zero


def test_megatron_lm_loop_checkpoint_continues_in_meshtron():
    from ckpt_helpers import train_on_from_megatron

    train_on_from_megatron(FIXTURE)
