"""The flags of ``meshtron train`` as data: one :class:`FlagSpec` per configuration field, the one conversion of
flag values (command-line strings and YAML values alike) and the reading of ``--config`` YAML files.

It sits below the command line (:mod:`meshtron.cli`, which builds its argparse parser from these specs) and below
the checkpoint reader (:mod:`meshtron.checkpoint.metadata`), which converts a saved ``config.yaml`` the same way a
``--config`` file is converted; neither imports the other for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from meshtron.config import SECTIONS, ConfigError, flag_name
from meshtron.launcher import LAUNCHER_FIELDS, launcher_option_strings
from meshtron.megatron_compat import MEGATRON_COMPAT, CompatFlag
from meshtron.presets import PRESETS

#: The help group of the Megatron-LM flags meshtron accepts without effect (:mod:`meshtron.megatron_compat`, and
#: fields declared ``opt(..., megatron_compat=True)`` whose only valid value is meshtron's).
COMPAT_TOPIC = "Megatron compatibility"

#: Help groups of `meshtron train --help`, in order.
TOPICS: tuple[str, ...] = (
    "Model", "Mixture of experts", "Parallelism", "Launcher", "Optimizer and learning rate", "Training",
    "Precision and recomputation", "Data and tokenizer", "Checkpoints", "Logging", COMPAT_TOPIC,
)
_SECTION_TOPIC = {"model": "Model", "parallel": "Parallelism", "optim": "Optimizer and learning rate",
                  "train": "Training", "data": "Data and tokenizer", "checkpoint": "Checkpoints", "log": "Logging"}
_PRECISION_FIELDS = ("bf16", "fp32", "fp16", "compile")
#: List flags whose YAML string is one item, not words: dataset prefixes (see meshtron.validation.data_path_items).
DATA_PATH_FIELDS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")

@dataclass(frozen=True)
class FlagSpec:
    """One configuration field as the command line and YAML files see it."""

    name: str                          # field name: YAML key and argparse dest
    section: str                       # MeshtronConfig attribute holding it ("model", ...)
    topic: str                         # help group title
    option_strings: tuple[str, ...]    # "--hidden-size" first, then aliases
    negative_strings: tuple[str, ...]  # "--no-..." forms of a boolean
    kind: type                         # bool, int, float, str or list (of str)
    optional: bool                     # None is a valid value
    choices: Optional[tuple]
    default: Any
    help: str
    nargs: Optional[str]
    metavar: Optional[str]

    @property
    def flag(self) -> str:
        """The primary spelling, e.g. ``--hidden-size``."""
        return self.option_strings[0]


# ---------------------------------------------------------------------------------------------
# Flag specifications, generated from the dataclasses.
# ---------------------------------------------------------------------------------------------

def _topic(section: str, name: str, megatron_compat: bool) -> str:
    if megatron_compat:
        return COMPAT_TOPIC
    if section == "model" and (name == "num_experts" or name.startswith("moe_")):
        return "Mixture of experts"
    if section == "launcher":
        return "Launcher"
    if section == "train" and (name in _PRECISION_FIELDS or name.startswith(("fp8", "recompute"))):
        return "Precision and recomputation"
    return _SECTION_TOPIC[section]


def _kind_of(annotation: Any) -> tuple[type, bool]:
    """(base type, optional) of a field annotation such as ``Optional[int]`` or ``list``."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if (origin is typing.Union or origin is types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return _kind_of(inner[0])[0], True
    base = origin or annotation
    if base not in (bool, int, float, str, list):
        raise TypeError(f"config field type {annotation!r} has no command-line form")
    return base, False


@functools.lru_cache(maxsize=None)
def flag_specs() -> tuple[FlagSpec, ...]:
    """Every configuration field as a :class:`FlagSpec`, in dataclass order."""
    specs: list[FlagSpec] = []
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, optional = _kind_of(hints[f.name])
            meta = f.metadata
            strings = (launcher_option_strings(f.name) if f.name in LAUNCHER_FIELDS
                       else tuple(dict.fromkeys([flag_name(f.name), *meta.get("aliases", ())])))
            negatives: tuple[str, ...] = ()
            if kind is bool:  # --x sets True, --no-x sets False (not for fields already named no_...)
                negatives = tuple("--no-" + s[2:] for s in strings if not s.startswith("--no-"))
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
            choices = tuple(PRESETS) if f.name == "model" else meta.get("choices")
            specs.append(FlagSpec(
                name=f.name, section=section, topic=_topic(section, f.name, meta.get("megatron_compat", False)),
                option_strings=strings,
                negative_strings=negatives, kind=kind, optional=optional, choices=choices, default=default,
                help=meta.get("help", ""), nargs=meta.get("nargs"), metavar=meta.get("metavar")))
    specs.extend(_compat_spec(flag) for flag in MEGATRON_COMPAT)
    _check_unique(specs)
    return tuple(specs)


#: The section of the flags that have no configuration field (:mod:`meshtron.megatron_compat`), and their names.
COMPAT_SECTION = "megatron_compat"
COMPAT_NAMES = frozenset(flag.name for flag in MEGATRON_COMPAT)


def _compat_spec(flag: CompatFlag) -> FlagSpec:
    strings = tuple(dict.fromkeys([flag_name(flag.name), *flag.aliases]))
    negatives = tuple("--no-" + s[2:] for s in strings if not s.startswith("--no-")) if flag.kind is bool else ()
    return FlagSpec(name=flag.name, section=COMPAT_SECTION, topic=COMPAT_TOPIC, option_strings=strings,
                    negative_strings=negatives, kind=flag.kind, optional=flag.optional, choices=flag.choices,
                    default=flag.default, help=flag.help, nargs=flag.nargs, metavar=None)


def _check_unique(specs: Sequence[FlagSpec]) -> None:
    seen: dict[str, str] = {}
    for spec in specs:
        for s in spec.option_strings + spec.negative_strings:
            if s in seen:
                raise RuntimeError(f"flag {s} is defined by both {seen[s]} and {spec.name}")
            seen[s] = spec.name


def flag_groups() -> list[tuple[str, list[FlagSpec]]]:
    """The flags of ``meshtron train`` grouped by help topic, in :data:`TOPICS` order."""
    by_topic: dict[str, list[FlagSpec]] = {t: [] for t in TOPICS}
    for spec in flag_specs():
        by_topic[spec.topic].append(spec)
    return [(t, specs) for t, specs in by_topic.items() if specs]


def spec_by_name() -> dict[str, FlagSpec]:
    """{field name: FlagSpec}."""
    return {s.name: s for s in flag_specs()}


# ---------------------------------------------------------------------------------------------
# Values: one conversion for command-line strings and YAML values alike.
# ---------------------------------------------------------------------------------------------

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def coerce(spec: FlagSpec, value: Any) -> Any:
    """Convert a command-line string or a YAML value to the field's type; ValueError says what is valid."""
    if value is None:
        if spec.optional or spec.kind is list:
            return [] if spec.kind is list else None
        raise ValueError("a value is required (null is not allowed)")
    if spec.kind is not list and spec.nargs == "+" and isinstance(value, (list, tuple)):
        # a per-layer list of a one-value field (--cp-comm-type): checked here, reduced to one value later
        return [coerce(dataclasses.replace(spec, nargs=None), v) for v in value]
    if spec.kind is list:
        if isinstance(value, dict):
            raise ValueError(f"expected a list of values, got a mapping {value!r}")
        if isinstance(value, (list, tuple)):
            items = value
        elif spec.name in DATA_PATH_FIELDS:  # one item, read like a command-line one (a path may hold spaces)
            items = [value]
        else:
            items = str(value).split()
        nested = [v for v in items if isinstance(v, (list, tuple, dict)) or v is None]
        if nested:
            raise ValueError(f"expected a flat list of values, got {nested[0]!r} in it")
        return [_check_choice(spec, str(v)) for v in items]
    if spec.kind is bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in _TRUE | _FALSE:
            return text in _TRUE
        raise ValueError(f"expected true or false, got {value!r}")
    if spec.kind is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value).strip())
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    if spec.kind is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            return float(str(value).strip())
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
    if isinstance(value, (bool, list, dict)):
        raise ValueError(f"expected a string, got {value!r}")
    return _check_choice(spec, str(value))


def _check_choice(spec: FlagSpec, text: str) -> str:
    if not spec.choices or text in spec.choices:
        return text
    folded = [c for c in spec.choices if c.lower() == text.lower()]
    if folded:  # e.g. "wsd" for "WSD"
        return folded[0]
    lowered = {c.lower(): c for c in spec.choices}
    close = difflib.get_close_matches(text.lower(), list(lowered), n=1)
    hint = f" (did you mean {lowered[close[0]]}?)" if close else ""
    raise ValueError(f"invalid value {text!r}{hint}; valid: {', '.join(spec.choices)}")


# ---------------------------------------------------------------------------------------------
# How a flag is shown in help and docs.
# ---------------------------------------------------------------------------------------------

def help_text(spec: FlagSpec) -> str:
    """The field's help plus its default, when there is one worth showing."""
    text = spec.help
    if spec.default not in (None, False, [], ""):
        shown = spec.default if not isinstance(spec.default, float) else f"{spec.default:g}"
        text += f" (default: {shown})"
    return text


def metavar_of(spec: FlagSpec) -> str:
    """The value placeholder shown in help: the field's metavar, ``{a,b}`` for choices, N, X, PATH or STR."""
    if spec.metavar:
        return spec.metavar
    if spec.choices:
        return "{" + ",".join(spec.choices) + "}"
    if spec.kind is int:
        return "N"
    if spec.kind is float:
        return "X"
    if spec.kind is list or spec.name in ("save", "load") or spec.name.endswith(("_file", "_path", "_dir", "_model")):
        return "PATH"
    return "STR"


# ---------------------------------------------------------------------------------------------
# --config YAML files.
# ---------------------------------------------------------------------------------------------

def load_yaml_config(path: str) -> dict[str, Any]:
    """{field: value} from a YAML file; keys may use ``_`` or ``-`` (and a leading ``--``). Raises ConfigError.

    The file must be UTF-8 text holding one mapping; a key given twice (also as ``a_b`` and ``a-b``) is an
    error rather than a silent choice of one value.
    """
    import yaml  # only when a config file is used

    text = _read_utf8(path)
    try:
        data = yaml.load(text, Loader=_unique_key_loader(yaml))  # a SafeLoader: plain data, no objects
    except yaml.YAMLError as err:
        where = getattr(err, "problem_mark", None)
        line = f" line {where.line + 1}" if where is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"--config: {path}{line}: invalid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config: {path} must hold a mapping of field: value, not a {type(data).__name__}")
    specs = spec_by_name()
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).lstrip("-").replace("-", "_")
        spec = specs.get(key)
        if spec is None:
            close = difflib.get_close_matches(key, list(specs), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{path}: unknown key {raw_key!r}{hint}")
        if key in out:
            raise ConfigError(f"{path}: {spec.flag} is given twice (keys {key!r} and {raw_key!r}): keep one")
        try:
            out[key] = coerce(spec, value)
        except ValueError as err:
            raise ConfigError(f"{path}: {raw_key}: {err} (flag {spec.flag})") from None
    return out


def _read_utf8(path: str) -> str:
    """The text of a configuration file, which must be UTF-8 (a byte order mark is allowed)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config: file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"--config: {path} is a directory, not a YAML file") from None
    except OSError as err:
        raise ConfigError(f"--config: cannot read {path} ({err.strerror})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[:err.start].count(b"\n") + 1
        raise ConfigError(f"--config: {path} is not UTF-8 text: byte 0x{raw[err.start]:02x} at byte offset "
                          f"{err.start} (line {line}); save the file as UTF-8") from None


def _unique_key_loader(yaml: types.ModuleType) -> type:
    """A SafeLoader subclass that refuses a mapping with the same key twice (PyYAML keeps the last)."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict:
            seen: set = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: SafeLoader's own error names it
                    break
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} appears twice", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader
