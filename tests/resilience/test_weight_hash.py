"""The weight-hash check across data-parallel replicas: a flipped bit is caught and named (--inject-fault bitflip)."""

from __future__ import annotations

import pytest
import torch

from meshtron.resilience.faults import flip_bit
from meshtron.resilience.weight_hash import outliers, tensor_hash
from tests.resilience.cli_runs import Run, clean_run, train


@pytest.fixture(scope="session")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return clean_run(str(tmp_path_factory.getbasetemp()))


def test_bitflip_on_one_of_three_replicas_is_caught_at_the_next_check(tmp_path) -> None:
    ck = tmp_path / "ck"
    run = train(tmp_path, 3, "--inject-fault", "bitflip:1:3", "--global-batch-size", "6", "--save", str(ck),
                "--save-interval", "2", "--log-straggler-interval", "0")
    assert run.returncode == 1
    assert run.of_type("weight_hash") == [{"type": "weight_hash", "iteration": 4, "ranks": [1], "majority": True}]
    errors = [line for line in run.stderr.splitlines() if "error: [rank" in line]
    # Every rank finds the mismatch; the launcher may stop the last ones before they print (torchrun ends a job's
    # other workers as soon as one has exited with an error).
    assert 1 <= len(errors) <= 3 and all("iteration 4" in e and "rank(s) 1 differ" in e for e in errors), errors
    # Iteration 2's checkpoint is the last one: none is written from the corrupt state at iteration 4.
    assert (ck / "latest").read_text().strip().endswith("2")


def test_clean_run_has_no_mismatch(clean: Run) -> None:
    assert clean.returncode == 0, clean.stderr
    assert clean.of_type("weight_hash") == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_single_bit_flip_changes_the_hash(dtype) -> None:
    t = torch.randn(257, generator=torch.Generator().manual_seed(0)).to(dtype)
    reference = tensor_hash(t)
    for bit in range(8 * t.element_size()):
        flipped = t.clone()
        flip_bit(flipped, 100, bit)
        assert bool((tensor_hash(flipped) != reference).any()), bit
    swapped = t.clone()
    swapped[[3, 4]] = t[[4, 3]]
    if not torch.equal(swapped, t):
        assert bool((tensor_hash(swapped) != reference).any())


def test_majority_names_the_odd_replica_and_two_replicas_name_both() -> None:
    # Rows [group key, A, B]: ranks 0-2 replicate one group, ranks 3-4 another.
    table = [[0, 5, 6], [0, 5, 7], [0, 5, 6], [3, 1, 1], [3, 1, 1]]
    assert outliers(table) == ([1], True)
    assert outliers([[0, 5, 6], [0, 5, 7]]) == ([0, 1], False)
    assert outliers([[0, 1, 1], [1, 2, 2]]) == ([], True)  # different groups never compare
