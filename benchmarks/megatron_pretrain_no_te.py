"""Megatron-LM's ``pretrain_gpt.py`` (run from its source directory), able to resume without Transformer Engine
or Apex.

Without TE or Apex, core_v0.19.0 cannot resume from any ``torch_dist`` checkpoint of its distributed optimizer
(its own included), for two reasons, each mended here and nothing else of Megatron changed:

- ``DistributedOptimizer.state_dict`` reads torch Adam's step from the optimizer's state and asserts that exactly
  one exists, but on loading the state is still empty. Before that call the state is filled with dummy values, as
  Megatron itself does when loading for Megatron-FSDP (``_init_optimizer_states_with_dummy_values``); the
  checkpoint's values replace them in place.
- ``_set_main_param_and_optimizer_states`` copies every tensor of a parameter's state from the checkpoint's, and
  torch Adam's ``step`` is such a tensor; but the loaders leave ``step`` out on purpose (``load_state_dict`` has
  already set it from the parameter groups), so the copy fails with KeyError 'step'. The step is kept as set.

Used by benchmarks/megatron_continuation.sh only.
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


_set_states = distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states


def _set_states_keeping_step(self, model_param, tensors):
    if not distrib_optimizer.HAVE_APEX_OR_TE and "step" not in tensors:
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        step = self.optimizer.state[main_param].get("step")
        if step is not None:
            tensors = dict(tensors, step=step)  # copied onto itself: the step load_state_dict set
    return _set_states(self, model_param, tensors)


distrib_optimizer.DistributedOptimizer.state_dict = _state_dict_after_dummy_init
distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states = _set_states_keeping_step
sys.argv[0] = "pretrain_gpt.py"
runpy.run_path("pretrain_gpt.py", run_name="__main__")
