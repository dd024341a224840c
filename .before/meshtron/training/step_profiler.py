"""``--profile``: record training steps ``[--profile-step-start, --profile-step-end)`` (Megatron-LM's flags).

With ``--use-pytorch-profiler`` the steps run under ``torch.profiler`` and a trace is written for
TensorBoard / Perfetto (``*.pt.trace.json``) into ``--profile-dir`` (default: ``--tensorboard-dir``,
else ``profile``); without it, the CUDA profiler's capture range is opened and closed around the steps
(``nsys profile --capture-range=cudaProfilerApi``). Only the ranks in ``--profile-ranks`` profile.
"""

from __future__ import annotations

import os
from typing import Optional

import torch


class StepProfiler:
    """Starts and stops the chosen profiler around a range of iterations; inactive when not asked for."""

    def __init__(self, enabled: bool, start: int, end: int, pytorch: bool, out_dir: str, device: torch.device,
                 rank: int, ranks: list[int]):
        self.active = enabled and rank in ranks
        self.start, self.end, self.pytorch = start, end, pytorch
        self.out_dir, self.device, self.rank = out_dir, device, rank
        self._torch_profiler: Optional[torch.profiler.profile] = None
        self._cuda_range = False

    def before_step(self, iteration: int) -> None:
        if not self.active or iteration != self.start:
            return
        if self.pytorch:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            os.makedirs(self.out_dir, exist_ok=True)
            handler = torch.profiler.tensorboard_trace_handler(self.out_dir, worker_name=f"rank{self.rank}")
            self._torch_profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                                          on_trace_ready=handler)
            self._torch_profiler.start()
        elif self.device.type == "cuda":
            torch.cuda.profiler.start()
            self._cuda_range = True

    def after_step(self, iteration: int) -> None:
        if self.active and iteration == self.end - 1:
            self.stop()

    def stop(self) -> None:
        """End the recording (also when training ends inside the range); writes the trace."""
        if self._torch_profiler is not None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self._torch_profiler.stop()
            self._torch_profiler = None
        if self._cuda_range:
            torch.cuda.profiler.stop()
            self._cuda_range = False
