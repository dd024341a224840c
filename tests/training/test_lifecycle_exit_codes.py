"""RunLifecycle's exit code for the user-facing error classes (one process, no process group)."""

from __future__ import annotations

import pytest

from meshtron.checkpoint.errors import CheckpointError, CheckpointSaveError
from meshtron.errors import ConfigError
from meshtron.training.lifecycle import RunLifecycle
from meshtron.training.trainer import TrainingError


@pytest.mark.parametrize("error, code", [
    (ConfigError("--lr: bad"), 2),
    (CheckpointError("--load ck: iter_4/__0_0.distcp does not match its checksum"), 2),
    (CheckpointSaveError("no space left on device"), 1),  # a save that failed while running
    (TrainingError("5 non-finite steps in a row"), 1),
])
def test_error_classes_give_their_exit_code(capsys, error, code):
    def body() -> int:
        raise error

    lifecycle = RunLifecycle("meshtron train", rank=0, world_size=1, timeout_s=5.0,
                             bad_input=(ConfigError, CheckpointError), failures=(TrainingError,))
    assert lifecycle.run(body) == code
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"meshtron train: error: {error}"]
