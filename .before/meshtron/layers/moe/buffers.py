"""Modules whose buffers (router bias, load statistics) are fp32 state, not weights."""

from __future__ import annotations

import torch
import torch.nn as nn

from meshtron.parallel.sharding import SPEC_ATTR


class Fp32BufferModule(nn.Module):
    """A module whose floating buffers stay fp32 through ``.to(dtype)``, and are zero-filled when
    materialised from the meta device (models are built on meta, then ``to_empty``). A buffer's
    :class:`~meshtron.parallel.sharding.ShardSpec` (if any) follows it to the new tensor."""

    def _apply(self, fn, recurse=True):
        before = {name: buf for name, buf in self._buffers.items() if buf is not None}
        super()._apply(fn, recurse)
        for name, old in before.items():
            buf = self._buffers[name]
            if buf.is_floating_point() and buf.dtype != torch.float32:
                # keep fp32 values exactly: move the old tensor rather than round-trip through bf16
                buf = buf.float() if old.is_meta else old.to(device=buf.device, dtype=torch.float32)
            if old.is_meta and not buf.is_meta:
                buf = buf.zero_()
            if hasattr(old, SPEC_ATTR) and not hasattr(buf, SPEC_ATTR):
                setattr(buf, SPEC_ATTR, getattr(old, SPEC_ATTR))
            self._buffers[name] = buf
        return self
