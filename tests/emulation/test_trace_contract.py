"""The trace contract (DESIGN.md section 13): an emulated rank issues exactly the operations of its real twin.

Each case runs ``meshtron train --nproc-per-node N --record-collectives`` on CPU gloo (the real ranks), then
``meshtron emulate --as-train --ranks all`` with the same flags (each rank alone, every collective emulated),
and compares the two traces of every rank operation by operation: iteration, op, group, group size, bytes and
dtype, in order. One fast case each for TP+SP, PP and ZeRO-3 (CP and EP have fast equivalence tests of their own); the rest are marked slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtron.emulation.trace import comparable, read_trace
from tests.resilience.cli_runs import free_port

REPO = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "1", "--vocab-size", "128", "--eval-interval", "0",
        "--log-interval", "1", "--train-iters", "2", "--hang-timeout-seconds", "0", "--rerun-mode", "disabled",
        "--no-check-for-nan-in-loss-and-grad"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]

CASES = {
    "tp_sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "2"]),
    "pp_1f1b": (2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]),
    "dp_zero3_overlap": (2, ["--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce",
                             "--global-batch-size", "4"]),
    "cp_ring": (2, ["--context-parallel-size", "2", "--global-batch-size", "2"]),
    "ep_capacity_padded": (2, MOE + ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "1.5",
                                     "--moe-pad-expert-input-to-capacity", "--global-batch-size", "4"]),
}
SLOW_CASES = {
    "pp_interleaved": (2, ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                           "--global-batch-size", "4"]),
    # Megatron's layout string: 3 layers on stage 0, 1 on stage 1
    "pp_layout_string": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettt|tL",
                             "--global-batch-size", "4"]),
    "pp_zero_bubble_h1": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble-h1",
                              "--global-batch-size", "4"]),
    "pp_zbv": (2, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                   "--untie-embeddings-and-output-weights", "--global-batch-size", "4"]),
    "dp_zero1_overlap": (2, ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
                             "--global-batch-size", "4"]),
    "dp_zero2": (2, ["--data-parallel-sharding-strategy", "optim_grads", "--global-batch-size", "4"]),
    "cp_allgather": (2, ["--context-parallel-size", "2", "--cp-comm-type", "allgather", "--global-batch-size", "2"]),
    "cp_a2a": (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--global-batch-size", "2"]),
    "ep_dropless": (2, MOE + ["--expert-model-parallel-size", "2", "--global-batch-size", "4"]),
    "mtp_tp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--mtp-num-layers", "1",
                   "--global-batch-size", "2"]),
    "tp2_pp2_zero1": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                          "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                          "--global-batch-size", "4"]),
}


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "meshtron"] + args, capture_output=True, text=True, env=env,
                          timeout=420, cwd=REPO)


def _without_dropless_bytes(records: list[tuple]) -> list[tuple]:
    """Dropless expert parallelism sends as many tokens as the router picked: the real ranks' all-to-all
    sizes follow their data, the emulated rank's a balanced exchange. Op, group and order must still agree."""
    return [r[:4] + (None,) + r[5:] if r[1] == "all_to_all" and r[2] == "ep" else r for r in records]


def _check_case(tmp_path: Path, world: int, flags: list[str], static_counts: bool = True) -> None:
    real = _run(["train", *TINY, *flags, "--nproc-per-node", str(world), "--master-port",
                 str(free_port()), "--record-collectives",
                 str(tmp_path / "real")])
    assert real.returncode == 0, real.stderr[-3000:]
    emulated = _run(["emulate", "--as-train", "--world-size", str(world), "--ranks", "all", *TINY, *flags,
                     "--record-collectives", str(tmp_path / "emulated")])
    assert emulated.returncode == 0, emulated.stderr[-3000:]
    assert "every collective is emulated" in emulated.stderr
    for rank in range(world):
        ours = read_trace(str(tmp_path / f"real.rank{rank}.jsonl"))
        twin = read_trace(str(tmp_path / f"emulated.rank{rank}.jsonl"))
        assert any(r["iteration"] == 2 for r in ours), "the trace covers the training steps"
        a, b = comparable(ours), comparable(twin)
        if not static_counts:
            a, b = _without_dropless_bytes(a), _without_dropless_bytes(b)
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        assert first is None and len(a) == len(b), (
            f"rank {rank}: traces differ at operation {first} (real {len(a)}, emulated {len(b)} operations): "
            f"real {a[first] if first is not None else a[len(b):][:1]} emulated "
            f"{b[first] if first is not None else b[len(a):][:1]}")


# CP and EP keep fast equivalence tests of their own; their trace cases are slow.
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("cp_ring", "ep_capacity_padded")
                                  else n for n in sorted(CASES)])
def test_emulated_rank_issues_the_real_ranks_operations(tmp_path, name):
    world, flags = CASES[name]
    _check_case(tmp_path, world, flags)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_CASES))
def test_emulated_rank_issues_the_real_ranks_operations_slow(tmp_path, name):
    world, flags = SLOW_CASES[name]
    _check_case(tmp_path, world, flags, static_counts=name != "ep_dropless")


def test_flex_attention_runs_under_the_recorder():
    """flex attention (sinks, sliding windows, packed documents) compiles itself even when called eagerly, which
    torch.compile refuses under a user dispatch mode: it runs outside the recorder, whose trace it adds nothing to."""
    import torch

    from meshtron.emulation.trace import CollectiveRecorder
    from meshtron.layers.documents import flex

    q, k, v = torch.randn(3, 1, 2, 32, 16).unbind(0)
    expected, expected_lse = flex(q, k, v, None, None, return_lse=True)
    with CollectiveRecorder(None) as recorder:
        out, lse = flex(q, k, v, None, None, return_lse=True)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse) and recorder.records == []


@pytest.mark.gpu
def test_compiled_flex_attention_trains_under_the_recorder_on_cuda():
    """On CUDA flex attention is the compiled kernel: forward and backward under the recorder (as in a recorded
    step of `meshtron emulate` or `--record-collectives`) give what they give without it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from meshtron.emulation.trace import CollectiveRecorder
    from meshtron.layers.documents import flex

    q, k, v = (torch.randn(1, 2, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    expected = flex(q, k, v, None, None)
    expected.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    with CollectiveRecorder(None) as recorder:
        out = flex(q, k, v, None, None)
        out.sum().backward()
    assert torch.equal(out, expected) and recorder.records == []
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), grads))
