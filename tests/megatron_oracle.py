"""megatron-core as a test oracle: its dataset builder and LR scheduler, imported without its package init.

megatron-core (the ``megatron-oracle`` extra, Python >= 3.12) is never imported by meshtron itself. Its
package ``__init__`` pulls in the training stack (Triton, Transformer Engine probes), which a CPU test
machine may lack; the pure-Python modules the tests need import fine on their own, so the package object is
created empty and only those submodules are loaded. ``MESHTRON_MEGATRON_CORE=DIR`` points at an unpacked
wheel (``DIR/megatron/core``) where the extra cannot be installed (Python < 3.12). The dataset helpers need
the compiled ``megatron.core.datasets.helpers_cpp`` (shipped in the wheel for its Python version).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types

import pytest


def _core_package():
    root = os.environ.get("MESHTRON_MEGATRON_CORE")
    if root and root not in sys.path:
        sys.path.insert(0, root)
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        pytest.skip("megatron-core is not installed (pip install -e .[megatron-oracle])")
    if "megatron.core" not in sys.modules:
        package = types.ModuleType("megatron.core")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["megatron.core"] = package
        importlib.import_module("megatron.core.parallel_state")  # resolves megatron.core.utils' import cycle
    return sys.modules["megatron.core"]


def scheduler_module():
    """``megatron.core.optimizer_param_scheduler``, or skip."""
    _core_package()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return importlib.import_module("megatron.core.optimizer_param_scheduler")
        except ImportError as err:
            pytest.skip(f"megatron-core's scheduler does not import here: {err}")


def dataset_modules():
    """(gpt_dataset, blended_megatron_dataset_builder, helpers) of megatron.core.datasets, or skip."""
    _core_package()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            helpers = importlib.import_module("megatron.core.datasets.helpers")
            gpt = importlib.import_module("megatron.core.datasets.gpt_dataset")
            builder = importlib.import_module("megatron.core.datasets.blended_megatron_dataset_builder")
        except ImportError as err:
            pytest.skip(f"megatron-core's dataset code does not import here (compiled helpers?): {err}")
    return gpt, builder, helpers


def null_tokenizer_class():
    """megatron-core's NullTokenizer (``megatron.core.tokenizers.text.libraries.null_tokenizer``), or skip."""
    _core_package()
    try:
        return importlib.import_module("megatron.core.tokenizers.text.libraries.null_tokenizer").NullTokenizer
    except ImportError as err:
        pytest.skip(f"megatron-core's NullTokenizer does not import here: {err}")
