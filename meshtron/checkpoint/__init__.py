"""Distributed checkpoints: canonical tensors through torch.distributed.checkpoint.

A checkpoint stores every canonical tensor (``layers.3.attention.q.weight``...) once,
with its global shape, as the chunks the saving ranks held, so that it loads into
any parallel layout. See docs/checkpoints.md for the on-disk format.
"""

from meshtron.checkpoint.async_save import finalize_async_saves, poll_async_saves
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.load import latest_checkpoint_config, load_checkpoint, load_for_inference, resolve_checkpoint
from meshtron.checkpoint.save import last_save_timings, save_checkpoint
from meshtron.checkpoint.save_lock import SaveDirLockedError, lock_save_dir
from meshtron.checkpoint.signals import SignalHandler, install_signal_handler

__all__ = [
    "CheckpointError", "SaveDirLockedError", "SignalHandler", "finalize_async_saves", "install_signal_handler",
    "last_save_timings", "latest_checkpoint_config", "load_checkpoint", "load_for_inference", "lock_save_dir",
    "poll_async_saves", "resolve_checkpoint", "save_checkpoint",
]
