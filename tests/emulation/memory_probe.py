"""Peak bytes of live tensor storages of one rank over three training steps (run as a script by
tests/emulation/test_memory_fidelity.py): ``real`` under torchrun (gloo), ``emulated RANK WORLD`` alone.

CPU tensors have no allocator statistics, so a dispatch mode counts every storage an operator creates
and finalizers subtract it when it is freed: the same count for a real rank and its emulated twin.
"""

from __future__ import annotations

import json
import os
import sys
import weakref

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages created while active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._alive: set[int] = set()

    def _freed(self, key: int, size: int) -> None:
        self._alive.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key, size = id(storage), storage.nbytes()
                if size and key not in self._alive:
                    self._alive.add(key)
                    self.live += size
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, key, size)
        return out


def peak_bytes(argv: list[str], world: int) -> int:
    from meshtron.bench import RandomTokens
    from meshtron.cli import build_config
    from meshtron.parallel.context import context_from_config
    from meshtron.training.trainer import Trainer
    from meshtron.validation import validate_config

    cfg = build_config(argv)
    validate_config(cfg, world)
    if os.environ.get("MESHTRON_EMULATED") == "1":
        from meshtron.emulation.process_group import BACKEND

        cfg.parallel.distributed_backend = BACKEND
    ctx = context_from_config(cfg)
    t = cfg.train
    data = RandomTokens(cfg.model.vocab_size, cfg.model.seq_length, t.micro_batch_size,
                        t.global_batch_size // (t.micro_batch_size * ctx.dp), t.seed)
    tracker = LiveBytes()
    with tracker:
        trainer = Trainer(cfg, ctx, data=data)
        batches = next(data.train_batches())
        for iteration in (1, 2, 3):
            trainer.train_step(batches, iteration)
    trainer.close()
    return tracker.peak


def main() -> None:
    mode, out, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    if mode == "real":
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        result = peak_bytes(argv, world)
        dist.destroy_process_group()
    else:
        from meshtron.emulation.runner import _enter_world

        rank, world = int(os.environ["EMULATED_RANK"]), int(os.environ["EMULATED_WORLD"])
        _enter_world(world, rank)
        os.environ["MESHTRON_EMULATED"] = "1"
        result = peak_bytes(argv, world)
    with open(f"{out}.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "peak_bytes": result}, f)


if __name__ == "__main__":
    main()
