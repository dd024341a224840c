"""Megatron-LM's pickled files, read without running code from them.

``model_optim_rng.pt``, ``distrib_optim.pt``, ``common.pt`` and the ``common_state`` entry of a torch_dist
checkpoint are ``torch.save`` archives whose pickle names Python objects: tensors and their storages,
``OrderedDict``, ``argparse.Namespace`` (Megatron-LM's ``args``), NumPy arrays and scalars (the RNG states),
``torch.dtype`` values, ``signal.Signals`` (``args.exit_signal``), and Megatron's own enums (``AttnBackend``,
``AttnMaskType``... in ``args``; the rerun state machine's in the common state). They go through :func:`torch.load`
with an unpickler that resolves only those names. Megatron's enums become stand-ins (:class:`MegatronEnum`) that
keep the class name and value: meshtron never imports Megatron. Anything else is refused by name, in one line,
before it is called.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import re
import types
from pathlib import Path
from typing import Any

import torch

from meshtron.checkpoint.errors import CheckpointError

#: (module, name) pairs these files may name.
ALLOWED = frozenset({
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "complex"),
    ("builtins", "bytearray"),
    ("_codecs", "encode"),  # how protocol 2 pickles bytes (NumPy arrays' data): encode(text, "latin1")
    ("argparse", "Namespace"),
    ("signal", "Signals"),  # Megatron-LM's args.exit_signal (an IntEnum: unpickling looks the member up)
    ("torch", "Size"), ("torch", "device"),
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.nn.parameter", "Parameter"), ("torch", "Tensor"),
    ("torch.serialization", "_get_layout"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
})
#: NumPy's dtype classes (``numpy.dtypes.UInt32DType``...), which NumPy 2 pickles by name.
_NUMPY_DTYPES = re.compile(r"^numpy\.dtypes$")
#: Megatron's enum modules (``megatron.core.transformer.enums``, ``megatron.core.enums``...).
_MEGATRON_ENUMS = re.compile(r"^megatron(\.[a-z_0-9]+)*\.enums$")
#: Megatron enums its checkpoints hold (in ``args`` or the common state) outside an ``enums`` module.
_MEGATRON_ENUM_NAMES = {("megatron.core.fp8_utils", "Fp8Recipe")} | {
    # the rerun state machine's mode and state in Megatron-LM's common state (``rerun_state_machine``)
    ("megatron.core.rerun_state_machine", name)
    for name in ("RerunMode", "RerunState", "RerunDiagnostic", "RerunValidationStatus")}


class RefusedGlobal(pickle.UnpicklingError):
    """The file names a Python object outside the allow-list."""

    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.qualified = f"{module}.{name}"


class MegatronEnum:
    """A stand-in for a Megatron enum member found in ``args``: its class name and value."""

    cls_name = "MegatronEnum"

    def __init__(self, value: Any):
        self.value = value

    def __eq__(self, other: Any) -> bool:
        return type(other) is type(self) and other.value == self.value

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.value))

    def __repr__(self) -> str:
        return f"{self.cls_name}({self.value!r})"


_ENUM_CLASSES: dict[tuple[str, str], type] = {}


def _enum_class(module: str, name: str) -> type:
    key = (module, name)
    if key not in _ENUM_CLASSES:
        _ENUM_CLASSES[key] = type(name, (MegatronEnum,), {"cls_name": f"{module}.{name}"})
    return _ENUM_CLASSES[key]


def _is_megatron_enum(module: str, name: str) -> bool:
    return bool(_MEGATRON_ENUMS.match(module)) or (module, name) in _MEGATRON_ENUM_NAMES


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves only :data:`ALLOWED`, torch dtypes, NumPy dtype classes and Megatron enums (as stand-ins)."""

    def find_class(self, module: str, name: str) -> Any:
        # protocol 2 (torch.save's) names Python 2 modules (__builtin__, copy_reg...): judged by their Python 3 names
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if _NUMPY_DTYPES.match(module) and name.endswith("DType"):
            return super().find_class(module, name)
        if module.startswith("megatron.") and _is_megatron_enum(module, name):
            return _enum_class(module, name)
        raise RefusedGlobal(module, name)


#: what torch.load takes as ``pickle_module``: pickle, with the restricted Unpickler.
_PICKLE_MODULE = types.ModuleType("meshtron_megatron_pickle")
_PICKLE_MODULE.Unpickler = RestrictedUnpickler
_PICKLE_MODULE.load = lambda f, **kw: RestrictedUnpickler(f, **kw).load()
_PICKLE_MODULE.__name__ = "pickle"


def load_pickled(source: str | Path | bytes, where: str) -> Any:
    """The object a ``torch.save`` archive (a file, or bytes read from ``where``) holds, on CPU, read with the
    restricted unpickler; CheckpointError in one line naming ``where`` otherwise."""
    f = io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else source
    try:
        return torch.load(f, map_location="cpu", pickle_module=_PICKLE_MODULE, weights_only=False)
    except RefusedGlobal as err:
        raise CheckpointError(f"Megatron-LM checkpoint file {where} names {err.qualified}, which a Megatron "
                              "checkpoint never holds: refusing to load it (no code from a checkpoint is run)") \
            from None
    except FileNotFoundError:
        raise CheckpointError(f"Megatron-LM checkpoint file {where} is missing") from None
    except Exception as err:  # truncated zip, garbage bytes, missing records: torch and zipfile errors vary
        text = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"Megatron-LM checkpoint file {where} is truncated or damaged ({type(err).__name__}: "
                              f"{text})") from None
