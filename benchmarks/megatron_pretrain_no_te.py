"""Megatron-LM's ``pretrain_gpt.py`` (run from its source directory), able to resume without Transformer Engine
or Apex.

core_v0.19.0's ``DistributedOptimizer.state_dict`` reads the Adam step from the optimizer's state when neither
TE nor Apex is installed, and asserts that exactly one step exists; on loading a ``torch_dist`` checkpoint the
state is still empty, so Megatron-LM without them cannot resume from any distributed-optimizer checkpoint (its own
included). Before that call this fills the state with dummy values, as Megatron itself does when loading for
Megatron-FSDP (``_init_optimizer_states_with_dummy_values``); the checkpoint's values replace them in place.
Nothing else of Megatron is changed. Used by benchmarks/megatron_continuation.sh only.
"""

import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
from megatron.core.optimizer import distrib_optimizer  # noqa: E402

_state_dict = distrib_optimizer.DistributedOptimizer.state_dict


def _state_dict_after_dummy_init(self):
    if not distrib_optimizer.HAVE_APEX_OR_TE and not self.optimizer.state:
        self._init_optimizer_states_with_dummy_values()
    return _state_dict(self)


distrib_optimizer.DistributedOptimizer.state_dict = _state_dict_after_dummy_init
sys.argv[0] = "pretrain_gpt.py"
runpy.run_path("pretrain_gpt.py", run_name="__main__")
