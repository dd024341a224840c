"""Unit tests of --inject-fault parsing and of each fault kind's effect on one process."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from meshtron.config import ConfigError
from meshtron.resilience.faults import FaultInjector, FaultSpec, check_faults, flip_bit, parse_fault
from meshtron.resilience.restart import restart_count, resume_candidates


def _cfg(*faults: str) -> SimpleNamespace:
    return SimpleNamespace(train=SimpleNamespace(inject_fault=list(faults)))


def test_parse_valid_specs():
    assert parse_fault("crash:1:5") == FaultSpec("crash", 1, 5)
    assert parse_fault("slow:0:3:0.25") == FaultSpec("slow", 0, 3, 0.25)
    assert parse_fault("NaN-Persistent:2:7") == FaultSpec("nan-persistent", 2, 7)
    assert parse_fault("bitflip:0:2:3") == FaultSpec("bitflip", 0, 2, 3.0)


@pytest.mark.parametrize("text", ["crash", "crash:1", "explode:0:1", "crash:a:1", "crash:0:0", "crash:-1:2",
                                  "slow:0:1", "slow:0:1:-2", "hang:0:1:5", "bitflip:0:1:40", "nan:0:1:2:3"])
def test_bad_specs_name_the_flag_and_the_form(text):
    with pytest.raises(ConfigError) as err:
        parse_fault(text)
    message = str(err.value)
    assert "--inject-fault" in message and "KIND:RANK:ITERATION[:ARG]" in message
    assert "\n" not in message


def test_check_against_the_job():
    with pytest.raises(ConfigError, match="rank 2 does not exist"):
        check_faults(["crash:2:1"], world_size=2)
    with pytest.raises(ConfigError, match="--train-iters 4"):
        check_faults(["hang:0:5"], world_size=1, train_iters=4)
    assert check_faults(["hang:1:4"], world_size=2, train_iters=4) == [FaultSpec("hang", 1, 4)]


def test_off_by_default():
    assert FaultInjector.from_config(_cfg(), rank=0) is None


def test_only_this_rank_and_only_the_first_attempt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    assert FaultInjector.from_config(_cfg("nan:1:2"), rank=0).active is False
    assert FaultInjector.from_config(_cfg("nan:1:2"), rank=1).active is True
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    restarted = FaultInjector.from_config(_cfg("nan:1:2", "crash:1:2"), rank=1)
    assert restarted.active is False
    loss = torch.tensor(2.0)
    assert restarted.corrupt_loss(2, 0, loss) is loss


def test_restart_count_and_resume_candidates():
    assert restart_count({}) == 0
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "2"}) == 2
    assert restart_count({"SLURM_RESTART_COUNT": "1"}) == 1
    assert resume_candidates(None, "ck", 0) == []
    assert resume_candidates(None, "ck", 1) == [("ck", False)]
    assert resume_candidates("ck", "ck", 0) == [("ck", True)]
    assert resume_candidates("ck", "ck", 2) == [("ck", False)]
    assert resume_candidates("base", "ck", 1) == [("ck", False), ("base", True)]


def test_nan_is_transient_and_nan_persistent_is_not():
    inj = FaultInjector([FaultSpec("nan", 0, 3), FaultSpec("nan-persistent", 0, 5)], rank=0)
    loss = torch.tensor(1.5)
    assert inj.corrupt_loss(2, 0, loss) is loss
    assert torch.isnan(inj.corrupt_loss(3, 0, loss))
    assert inj.corrupt_loss(3, 1, loss) is loss  # the re-run of iteration 3 is clean
    for attempt in range(3):
        assert torch.isnan(inj.corrupt_loss(5, attempt, loss))
    grads = [torch.ones(4), torch.ones(2, 2)]
    inj.corrupt_grads(3, 1, grads)
    assert all(torch.isfinite(g).all() for g in grads)
    inj.corrupt_grads(3, 0, grads)
    assert all(torch.isnan(g).all() for g in grads)


def test_bitflip_changes_exactly_one_bit_once():
    params = [torch.zeros(0), torch.full((3, 4), 0.75)]
    before = params[1].clone()
    inj = FaultInjector([FaultSpec("bitflip", 0, 2)], rank=0)
    inj.after_optimizer_step(1, params)
    assert torch.equal(params[1], before)
    inj.after_optimizer_step(2, params)
    changed = (params[1] != before).nonzero()
    assert changed.shape[0] == 1 and inj.last_flip == (1, 6, 22)
    diff = params[1].view(-1).view(torch.int32) ^ before.view(-1).view(torch.int32)
    assert int(diff[6]) == 1 << 22 and torch.isfinite(params[1]).all()
    inj.after_optimizer_step(2, params)  # fires once
    assert (params[1] != before).sum() == 1


@pytest.mark.parametrize("dtype,bit", [(torch.float32, 31), (torch.bfloat16, 22), (torch.float64, 0)])
def test_flip_bit_any_width(dtype, bit):
    t = torch.ones(5, dtype=dtype)
    flip_bit(t, 2, bit)
    assert (t != 1).sum() == 1
    flip_bit(t, 2, bit)
    assert torch.equal(t, torch.ones(5, dtype=dtype))


def test_slow_sleeps_from_its_iteration_on():
    inj = FaultInjector([FaultSpec("slow", 0, 3, 0.2)], rank=0)
    start = time.monotonic()
    inj.at_iteration_start(2)
    assert time.monotonic() - start < 0.15
    for iteration in (3, 4):
        start = time.monotonic()
        inj.at_iteration_start(iteration)
        assert time.monotonic() - start >= 0.2


def _crash_at(iteration: int) -> None:
    inj = FaultInjector([FaultSpec("crash", 0, 2)], rank=0)
    for i in range(1, iteration + 1):
        inj.at_iteration_start(i)


def _hang_at(iteration: int) -> None:
    FaultInjector([FaultSpec("hang", 0, iteration)], rank=0).hang_point(iteration)


def test_crash_dies_as_sigkill_would():
    proc = mp.get_context("spawn").Process(target=_crash_at, args=(3,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL


def test_crash_spares_other_iterations_and_ranks():
    FaultInjector([FaultSpec("crash", 0, 2)], rank=0).at_iteration_start(1)  # this process lives on
    FaultInjector([FaultSpec("crash", 1, 2)], rank=0).at_iteration_start(2)


def test_hang_blocks_until_killed():
    proc = mp.get_context("spawn").Process(target=_hang_at, args=(4,))
    proc.start()
    proc.join(2.0)
    try:
        assert proc.is_alive()
    finally:
        proc.kill()
        proc.join(10)


@pytest.mark.parametrize("argv,expected", [
    (["--inject-fault", "explode:0:1"], "--inject-fault 'explode:0:1': unknown kind"),
    (["--inject-fault", "crash:3:1"], "rank 3 does not exist in a world of 1"),
    (["--hang-timeout-seconds", "900"], "--hang-timeout-seconds (900) must be below --distributed-timeout-minutes"),
    (["--max-restarts", "-1"], "--max-restarts must be >= 0"),
])
def test_bad_resilience_flags_exit_2_with_one_line(argv, expected, capsys):
    from meshtron.cli import main

    assert main(["train", "--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err
    # The quick-start job's notice comes first (no model or data given), then the one line of the error.
    lines = [line for line in err.splitlines() if not line.startswith("meshtron train: note: no --model")]
    assert expected in err and len(lines) == 1


def test_inject_fault_is_repeatable():
    from meshtron.cli import build_config

    cfg = build_config(["--inject-fault", "crash:0:2", "slow:1:1:0.5", "--inject-fault", "hang:1:3"])
    assert cfg.train.inject_fault == ["crash:0:2", "slow:1:1:0.5", "hang:1:3"]
