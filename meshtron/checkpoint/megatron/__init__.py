"""Reading Megatron-LM checkpoints (``torch_dist`` and the legacy ``mp_rank_*`` files) into meshtron's
canonical tensors, without running code from them, and writing ``torch_dist`` ones. See
docs/migrating-from-megatron.md.

One module per job: :mod:`.detect` (is a directory a Megatron checkpoint, which iteration and format),
:mod:`.unpickler` (the restricted unpickler for the pickled parts), :mod:`.torch_dist` and :mod:`.legacy` (the
two file formats, read into Megatron's whole tensors), :mod:`.names` (Megatron's names and layouts to
meshtron's canonical tensors), :mod:`.args` (the checkpoint's ``args`` as meshtron model flags, and the
comparison with this run's), :mod:`.reader` (all of it for one checkpoint) and :mod:`.into_model` (a
running model and optimizer filled from it). Writing: :mod:`.export` (a meshtron checkpoint as Megatron's tensors,
``args``, scheduler and optimizer state; :mod:`.names` maps the names back) and :mod:`.files` (the iteration
directory and the tracker file).
"""

from meshtron.checkpoint.megatron.detect import MegatronCheckpoint, find_megatron_checkpoint, looks_like_megatron

__all__ = ["MegatronCheckpoint", "find_megatron_checkpoint", "looks_like_megatron"]
