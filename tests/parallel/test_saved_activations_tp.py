"""What a compiled layer keeps for backward under TP=2 + sequence parallelism equals the memory model's count
(fp32 on the CPU; with selective recomputation and with FP8 too, those two marked slow), and SwiGLU's down
projection runs no extra matmul in its backward: the compiled graph neither keeps the down projection's
whole-sequence output nor recomputes it; its gradients equal the eager layer's."""

from __future__ import annotations

import pytest
import torch

from meshtron.memory import layer_activation_bytes
from tests.checkpoint.ckpt_helpers import tiny_config
from tests.distributed.launch import run_distributed
from tests.layers.saved_tensors import backward_matmuls, saved_storages

SEQ, BATCH, H = 32, 2, 64
VARIANTS = (("plain", False, False), ("selective", True, False), ("fp8", False, True))


def _layer(selective: bool, fp8: bool, compiled: bool):
    from meshtron.layers.linear import enable_fp8
    from meshtron.model import GPTModel
    from meshtron.parallel.context import build_groups
    from meshtron.parallel.sharding import initialize_parameters

    ctx = build_groups(2, 1, 1, 1, torch.device("cpu"))
    cfg = tiny_config(num_layers=1, hidden_size=H, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      seq_length=SEQ)
    model = GPTModel(cfg.model, ctx, 128, layer_ids=[0], sequence_parallel=True, selective_recompute=selective)
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    layer = model.layers["0"]
    if fp8:
        enable_fp8(layer, "hybrid")
    if compiled:
        layer.compile()
    return cfg, model, layer


def _saved_and_matmuls(selective: bool, fp8: bool) -> tuple[int, int, float, float]:
    """(bytes saved, backward matmuls, the memory model's count, largest gradient difference to eager)."""
    cfg, model, layer = _layer(selective, fp8, compiled=True)
    rope = model._rope(SEQ, None, torch.device("cpu"), torch.float32)
    tables = {t.untyped_storage().data_ptr() for t in rope}
    x = torch.randn(SEQ // 2, BATCH, H, generator=torch.Generator().manual_seed(3))  # this rank's shard
    for _ in range(2):  # the second call runs the compiled graphs
        xin = x.clone().requires_grad_()
        out, storages = saved_storages(layer, xin, rope, None, params=list(model.parameters()))
        layer.zero_grad()
        matmuls = backward_matmuls(out, fp8=fp8)
    # The same gradients as the eager layer (whose equivalence with one process the TP suites check).
    _, eager_model, eager = _layer(selective, fp8, compiled=False)
    xe = x.clone().requires_grad_()
    eager(xe, rope, None).square().sum().backward()
    diff = max((a - b).abs().max().item() for a, b in zip([xin.grad] + [p.grad for p in layer.parameters()],
                                                            [xe.grad] + [p.grad for p in eager.parameters()]))
    # Not counted by the model: the tables, and the FP8 scales (one fp32 element each).
    saved = sum(n for ptr, n in storages.items() if ptr not in tables and n > 4)
    expected = layer_activation_bytes(cfg.model, micro_batch=BATCH, seq=SEQ, tp=2, sequence_parallel=True,
                                      act_bytes=4, recompute="selective" if selective else None, fp8=fp8,
                                      merged_gathers=True)  # the CPU's compiler merges the all-gathers
    return saved, matmuls, expected, diff


def _worker(rank, world, names):
    return {name: _saved_and_matmuls(selective, fp8) for name, selective, fp8 in VARIANTS if name in names}


def _check(names: list[str]) -> None:
    results = run_distributed(_worker, 2, names, timeout=600)
    for rank_result in results:
        assert sorted(rank_result) == sorted(names)
        for name, (saved, matmuls, expected, diff) in rank_result.items():
            assert saved == expected, (name, saved, expected)
            assert diff < 1e-5, (name, diff)
        # Four linears, two gradient matmuls each (input and weight), none recomputed.
        assert [rank_result[name][1] for name in names] == [8] * len(names)


def test_compiled_tp_sp_layer_saves_what_the_model_counts():
    _check(["plain"])


# Slow: variants of the plain layer above. Selective recomputation under TP + SP trains like one process in
# tests/parallel/test_tp_training.py, and the compiled FP8 layer's count is checked in one process in
# tests/layers/test_saved_activations.py (test_fp8_layer_keeps_no_weight_copy[compiled]).
@pytest.mark.slow
def test_compiled_tp_sp_layer_with_selective_recomputation_or_fp8_saves_what_the_model_counts():
    _check(["selective", "fp8"])
