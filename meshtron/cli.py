"""``meshtron <command>``: the command-line entry point.

``meshtron train`` exposes every field of the configuration dataclasses in
:mod:`meshtron.config` as a Megatron-named flag (``hidden_size`` ->
``--hidden-size``), generated from the fields' metadata. Values come, in
increasing precedence, from the dataclass defaults, the ``--model`` preset, the
``--config`` YAML file and the command line. Errors are one line, exit code 2.

Heavy modules (torch, the trainer) are imported only inside the command that
needs them, so ``meshtron --help`` stays fast.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import importlib
import os
import re
import sys
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from meshtron import __version__, quickstart
from meshtron.allocator import default_to_expandable_segments
from meshtron.config import ConfigError, MeshtronConfig, flag_name
from meshtron.flags import (COMPAT_NAMES, COMPAT_TOPIC, TOPICS, FlagSpec, coerce, flag_specs, help_text,
                            load_yaml_config, metavar_of)
from meshtron.megatron_compat import MEGATRON_COMPAT
from meshtron.presets import PRESETS, PUBLISHED_ACTIVE, apply_preset, count_parameters
from meshtron.quickstart import SHAPE_FIELDS, quickstart_base
from meshtron.run_layout import RunLayout
from meshtron.validation import validate_config, validate_run

PROG = "meshtron"

#: command -> one-line description (the order of `meshtron --help`).
COMMANDS: dict[str, str] = {
    "train": "Pre-train a model (Megatron-style flags and/or --config FILE.yaml).",
    "presets": "List the named model shapes with their parameter counts.",
    "generate": "Sample text from a checkpoint.",
    "preprocess": "Turn text/JSONL documents into Megatron .bin/.idx datasets.",
    "tokenizer": "Train a tokenizer.",
    "convert": "Convert checkpoints to and from Hugging Face (a checkpoint loads into any layout as it is).",
    "bench": "Run a matrix of benchmark configurations and print a table.",
    "plot": "Draw figures from metrics files (loss, throughput, stragglers) or bench rows.",
    "emulate": "Run chosen ranks of an N-GPU layout for real on this device, every collective emulated; "
               "predict the step.",
    "doctor": "Check every device's and link's speed before a job; name the slow ones (exit 1).",
    "plan": "Plan a run without GPUs: search layouts (--gpus N), exact static memory (--dry-run), --calibrate.",
}

#: commands implemented in other modules: command -> (module, function taking the remaining arguments).
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("meshtron.generate", "generate_main"),
    "preprocess": ("meshtron.data.preprocess", "preprocess_main"),
    "tokenizer": ("meshtron.data.tokenizer_train", "tokenizer_main"),
    "convert": ("meshtron.checkpoint.convert", "convert_main"),
    "bench": ("meshtron.bench", "bench_main"),
    "plot": ("meshtron.plot", "plot_main"),
    "emulate": ("meshtron.emulation.cli", "emulate_main"),
    "doctor": ("meshtron.doctor", "doctor_main"),
    "plan": ("meshtron.planning.cli", "plan_main"),
}

#: Without --model and without any of SHAPE_FIELDS, the "tiny" preset is applied.
DEFAULT_PRESET = "tiny"

#: List flags that may be given several times, each time adding its values (``--inject-fault a --inject-fault b``).
_REPEATABLE_FIELDS = ("inject_fault",)


# ---------------------------------------------------------------------------------------------
# The argparse parser of `meshtron train`.
# ---------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are ConfigErrors (printed by :func:`main` as one line, exit 2)."""

    def error(self, message: str) -> typing.NoReturn:  # type: ignore[override]
        # "argument --a/--b: msg" -> "--a: msg"
        raise ConfigError(re.sub(r"^argument (--[^/:\s]+)(?:/[^:\s]+)*: ", r"\1: ", message))


class _BoolFlag(argparse.Action):
    """``--x`` stores True, ``--no-x`` stores False."""

    def __init__(self, option_strings: Sequence[str], dest: str, negatives: Sequence[str] = (), **kwargs: Any):
        self.negatives = frozenset(negatives)
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, option_string not in self.negatives)


def _argparse_type(spec: FlagSpec) -> Callable[[str], Any]:
    element = dataclasses.replace(spec, kind=str, optional=False) if spec.kind is list else spec

    def convert(text: str) -> Any:
        try:
            return coerce(element, text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = spec.kind.__name__
    return convert


def train_parser() -> argparse.ArgumentParser:
    """The parser of ``meshtron train``; every default is SUPPRESS so that only given flags appear."""
    parser = _Parser(
        prog=f"{PROG} train", usage=f"{PROG} train [--config FILE.yaml] [flags]", allow_abbrev=False,
        argument_default=argparse.SUPPRESS,
        description="Pre-train a decoder-only transformer. Values come from the dataclass defaults, then the "
                    "--model preset (default 'tiny' when no shape is given), then --config, then these flags. "
                    "Megatron-LM's flag names are accepted; see docs/cli.md.",
    )
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="YAML file of {field: value} (keys are the flag names with '_' or '-'); "
                             "flags on the command line override it.")
    groups = {topic: parser.add_argument_group(topic) for topic in TOPICS}
    for spec in flag_specs():
        group = groups[spec.topic]
        helptext = help_text(spec).replace("%", "%%").replace("%%%%", "%%")  # config help may pre-escape %
        if spec.kind is bool:
            group.add_argument(*spec.option_strings, *spec.negative_strings, dest=spec.name, action=_BoolFlag,
                               negatives=spec.negative_strings, help=helptext)
            continue
        metavar = metavar_of(spec)
        action = "extend" if spec.name in _REPEATABLE_FIELDS else "store"
        group.add_argument(*spec.option_strings, dest=spec.name, type=_argparse_type(spec), nargs=spec.nargs,
                           metavar=metavar, help=helptext, action=action)
    return parser


# ---------------------------------------------------------------------------------------------
# Building the configuration.
# ---------------------------------------------------------------------------------------------

@dataclass
class TrainArgs:
    """The result of parsing ``meshtron train`` arguments."""

    config: MeshtronConfig
    given: dict[str, Any]   # {field: value} given in the YAML file or on the command line
    config_file: Optional[str] = None
    quickstart_defaults: tuple[str, ...] = ()  # the quick-start settings that no flag overrode
    quickstart_adapted: dict[str, str] = dataclasses.field(default_factory=dict)  # name -> how it was adapted


def build_config(argv: Sequence[str]) -> MeshtronConfig:
    """The configuration described by ``meshtron train`` arguments (not yet validated).

    Precedence: dataclass defaults < preset < YAML values < command-line flags. Raises ConfigError.
    """
    return parse_train_args(argv).config


def parse_train_args(argv: Sequence[str]) -> TrainArgs:
    """Parse ``meshtron train`` arguments into a :class:`TrainArgs`. Raises ConfigError."""
    parser = train_parser()
    namespace, extras = parser.parse_known_args(list(argv))
    if extras:
        raise ConfigError(_unknown_argument_message(extras, parser))
    flags = vars(namespace)
    config_file = flags.pop("config", None)
    from_yaml = load_yaml_config(config_file) if config_file else {}

    given = _one_value_per_field({**from_yaml, **flags})
    base = quickstart_base(given, config_file)
    cfg = MeshtronConfig()
    preset = given.get("model", base.get("model"))
    if preset is None and not any(name in given for name in SHAPE_FIELDS):
        preset = DEFAULT_PRESET
    if preset is not None:
        apply_preset(cfg.model, preset)
    for name, value in {**base, **given}.items():
        if name != "model" and name not in COMPAT_NAMES:  # accepted, noted, never part of the configuration
            cfg.set(name, copy.deepcopy(value))
    if cfg.checkpoint.use_checkpoint_args:
        _apply_checkpoint_model_args(cfg, given)
    _check_compat_values(given, cfg)
    return TrainArgs(cfg, given, config_file, tuple(name for name in base if name not in given))


def _one_value_per_field(given: dict[str, Any]) -> dict[str, Any]:
    """Megatron's per-layer ``--cp-comm-type`` list as meshtron's one value (a mixed list is refused), and
    ``--hierarchical-context-parallel-sizes`` as integers."""
    from meshtron.cp_comm_types import single_comm_type

    if isinstance(given.get("cp_comm_type"), list):
        given["cp_comm_type"] = single_comm_type(given["cp_comm_type"])
    if "hierarchical_context_parallel_sizes" in given:
        try:
            given["hierarchical_context_parallel_sizes"] = [int(v) for v in given["hierarchical_context_parallel_sizes"]]
        except ValueError:
            raise ConfigError("--hierarchical-context-parallel-sizes: expected integers, got "
                              f"{' '.join(map(str, given['hierarchical_context_parallel_sizes']))}") from None
    return given


def _check_compat_values(given: dict[str, Any], cfg: MeshtronConfig) -> None:
    """The Megatron compatibility flags whose values meshtron can still get wrong (the others take any value of
    their type): a value with a ``refuse`` rule (:mod:`meshtron.megatron_compat`), and combinations."""
    for flag in MEGATRON_COMPAT:
        rule = flag.rule_for(given[flag.name]) if flag.name in given else None
        if rule is not None and rule.action == "refuse":
            raise ConfigError(f"{_shown_compat_value(flag.name, given[flag.name])}: {rule.message}")
    if given.get("offload_modules") and not cfg.train.offload_activations:
        raise ConfigError("--offload-modules needs --offload-activations (or --fine-grained-activation-offloading)")
    if given.get("timing_log_level", 0) not in (0, 1, 2):
        raise ConfigError(f"--timing-log-level must be 0, 1 or 2, got {given['timing_log_level']}")
    bf16_reduce = ("--main-grads-dtype bf16" if cfg.optim.main_grads_dtype == "bf16"
                   else "--grad-reduce-in-bf16" if cfg.parallel.grad_reduce_in_bf16 else None)
    if given.get("accumulate_allreduce_grads_in_fp32") and bf16_reduce:
        raise ConfigError(f"--accumulate-allreduce-grads-in-fp32 asks for fp32 gradient reduction and {bf16_reduce} "
                          f"for bf16: drop one of them")


def _shown_compat_value(name: str, value: Any) -> str:
    """``--flag`` for True, ``--flag a b`` for a list, ``--flag value`` otherwise."""
    flag = flag_name(name)
    if value is True:
        return flag
    return f"{flag} {' '.join(map(str, value))}" if isinstance(value, list) else f"{flag} {value}"


def quickstart_notice(args: TrainArgs) -> Optional[str]:
    """The one line that lists the quick-start settings a run uses, and how each adapted one was (None: none)."""
    return quickstart.notice(args.config, args.quickstart_defaults, args.quickstart_adapted, PROG)


def adapt_quickstart(args: TrainArgs, world_size: Optional[int]) -> None:
    """Adapt the quick-start defaults in use to the flags given and the world size (:mod:`meshtron.quickstart`)."""
    args.quickstart_adapted = quickstart.adapt(args.config, args.given, args.quickstart_defaults, world_size)


def _apply_checkpoint_model_args(cfg: MeshtronConfig, given: dict) -> None:
    """``--use-checkpoint-args``: the model section of the configuration saved with ``--load``'s checkpoint
    replaces the model flags; one given explicitly with another value is an error."""
    from meshtron.checkpoint import latest_checkpoint_config
    from meshtron.config import ModelConfig

    if not cfg.checkpoint.load:
        raise ConfigError("--use-checkpoint-args needs --load DIR (the checkpoint whose configuration to use)")
    from meshtron.checkpoint.errors import CheckpointError

    try:
        saved = latest_checkpoint_config(cfg.checkpoint.load)
    except CheckpointError as err:  # a damaged config.yaml: bad input like any other, named in one line
        raise ConfigError(f"--use-checkpoint-args: {err}") from None
    if saved is None:
        raise ConfigError(f"--use-checkpoint-args: no checkpoint in --load {cfg.checkpoint.load}")
    for f in dataclasses.fields(ModelConfig):
        value = getattr(saved.model, f.name)
        if f.name != "model" and f.name in given and given[f.name] != value:
            raise ConfigError(f"{flag_name(f.name)} {given[f.name]} contradicts the checkpoint's {value} "
                              f"(--use-checkpoint-args takes the model from {cfg.checkpoint.load}): drop the flag")
        setattr(cfg.model, f.name, copy.deepcopy(value))


def _unknown_argument_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    first = extras[0]
    if not first.startswith("-"):
        return f"unexpected argument {first!r} (flags start with --; see {PROG} train --help)"
    name = first.split("=", 1)[0]
    known = [s for action in parser._actions for s in action.option_strings]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else f" (see {PROG} train --help)"
    return f"unknown flag {name}{hint}"


# ---------------------------------------------------------------------------------------------
# Commands.
# ---------------------------------------------------------------------------------------------

def _is_rank_zero() -> bool:
    return os.environ.get("RANK", "0") == "0"


def compat_notices(args: TrainArgs) -> list[str]:
    """One line per Megatron-compatibility flag the user gave: a note, then the warnings (``WARNING``, in capitals,
    for a value whose no-op changes what a Megatron user gets: :mod:`meshtron.megatron_compat`)."""
    notes, warnings = [], []
    compat = {flag.name: flag for flag in MEGATRON_COMPAT}
    for spec in flag_specs():
        if spec.topic == COMPAT_TOPIC and spec.name in args.given:
            value = args.given[spec.name]
            shown = _shown_compat_value(spec.name, value)
            rule = compat[spec.name].rule_for(value) if spec.name in compat else None
            if rule is not None and rule.action == "warn":
                warnings.append(f"{PROG} train: WARNING: {shown}: {rule.message}")
            else:
                notes.append(f"{PROG} train: note: {shown}: {spec.help}")
    return notes + warnings


def train_main(argv: Sequence[str]) -> int:
    """``meshtron train``: build and validate the config, then train (or launch the workers that will)."""
    from meshtron import launcher
    from meshtron.slurm import adopt_slurm_environment, check_not_doubly_launched

    args = parse_train_args(argv)
    cfg = args.config
    launching = launcher.should_launch(cfg.launcher)
    if launching:
        world_size = _planned_world_size(cfg)
    else:
        if not cfg.train.dry_run:
            adopt_slurm_environment()  # srun with one task per GPU: rank, world size and master from SLURM's variables
        world_size = launcher.env_world_size()
    adapt_quickstart(args, world_size)
    # The notices come first, before any error: an error about a quick-start default is read with that default
    # in sight. The launching process speaks for the workers it starts.
    if _is_rank_zero() and not launcher.launched_by_meshtron():
        for line in filter(None, [quickstart_notice(args), *compat_notices(args)]):
            print(line, file=sys.stderr)
    launcher.check_launcher(cfg.launcher)  # a bad --nproc-per-node is named before a world size is made of it
    if cfg.train.dry_run:  # the plan of this run, in this process: no launch, no process group
        return _load_entry("train", "meshtron.planning.cli", "dry_run")(cfg, world_size)
    if launching:
        check_not_doubly_launched(os.environ, cfg.launcher.nproc_per_node)
        # Errors once, here, rather than in every worker; a copy, since each worker validates its own.
        launcher.check_local_gpus(validate_config(copy.deepcopy(cfg), launcher.planned_world_size(cfg.launcher)))
        return launcher.launch(cfg.launcher, argv)
    try:
        layout = validate_run(cfg, world_size)  # once per worker: the trainer reads this layout, not the flags
    except ConfigError:
        if not _is_rank_zero():
            return 2  # every rank has the same config: rank 0 alone says what is wrong
        raise
    run_training = _load_entry("train", "meshtron.training.trainer", "run_training")
    return _run_worker(cfg, world_size, run_training, layout)


def _planned_world_size(cfg: MeshtronConfig) -> Optional[int]:
    """The world size the shortcut will start; None when elastic or when the launcher flags are wrong (the
    check that follows the notices names the flag)."""
    from meshtron import launcher

    try:
        launcher.check_launcher(cfg.launcher)
    except ConfigError:
        return None
    return launcher.planned_world_size(cfg.launcher)


def _run_worker(cfg: MeshtronConfig, world_size: int, run_training: Callable[..., Any], layout: RunLayout) -> int:
    """Train in this process under a :class:`~meshtron.training.lifecycle.RunLifecycle`, which reports
    an error raised during the run (possibly on some ranks only: each rank reports its own), tears
    threads and process groups down in order on every exit path and gives the exit code."""
    from meshtron import launcher
    from meshtron.training.lifecycle import RunLifecycle

    bad_input, failures = _runtime_errors(run_training)
    lifecycle = RunLifecycle(f"{PROG} train", rank=int(os.environ.get("RANK", "0")), world_size=world_size,
                             timeout_s=60.0 * cfg.parallel.distributed_timeout_minutes,
                             bad_input=bad_input, failures=failures,
                             quiet_interrupt=launcher.launched_by_meshtron(),
                             on_exit_code=launcher.report_exit_status)

    def body() -> int:
        result = run_training(cfg, layout)  # validated above: run_training does not validate again
        return result if isinstance(result, int) else 0

    return lifecycle.run(body)


def _runtime_errors(run_training: Callable[..., Any]) -> tuple[tuple[type[BaseException], ...],
                                                                 tuple[type[BaseException], ...]]:
    """The user-facing error classes a run can raise, as (bad input: exit 2, failures: exit 1).

    Bad input: configuration and data errors, a checkpoint that does not match; failures: the trainer's.
    """
    bad_input: list[type[BaseException]] = [ConfigError]
    failures: list[type[BaseException]] = []
    trainer_error = getattr(sys.modules.get(run_training.__module__), "TrainingError", None)
    if isinstance(trainer_error, type):
        failures.append(trainer_error)
    try:
        from meshtron.checkpoint.errors import CheckpointError
    except ImportError:
        pass
    else:
        bad_input.append(CheckpointError)
    return tuple(bad_input), tuple(failures)


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(int(n))


def preset_rows() -> list[dict[str, Any]]:
    """One dict per preset: its shape, computed parameter count, published count and the difference in %."""
    from meshtron.config import ModelConfig, ffn_size, num_kv_heads

    rows = []
    for name, (_, published, source) in PRESETS.items():
        m = ModelConfig()
        apply_preset(m, name)
        counts = count_parameters(m)
        params = counts["total"]
        rows.append({
            "name": name, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "num_query_groups": num_kv_heads(m),
            "ffn_hidden_size": ffn_size(m), "num_experts": m.num_experts, "moe_router_topk": m.moe_router_topk,
            "vocab_size": m.vocab_size, "params": params, "published_params": published,
            "active_params": counts["active"] if m.num_experts else None,
            "published_active_params": PUBLISHED_ACTIVE.get(name, (None,))[0],
            "diff_percent": None if not published else 100.0 * (params - published) / published,
            "source": source,
        })
    return rows


def presets_main(argv: Sequence[str]) -> int:
    """``meshtron presets [--json]``: the table of named model shapes."""
    import json

    parser = _Parser(prog=f"{PROG} presets", description="List the model presets (use one with --model NAME).",
                     allow_abbrev=False)
    parser.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    opts = parser.parse_args(list(argv))
    rows = preset_rows()
    if opts.json:
        print(json.dumps(rows, indent=2))
        return 0
    header = ("name", "layers", "hidden", "heads/kv", "ffn", "experts", "vocab", "params", "published", "diff",
              "active", "published active")
    table = [header]
    for r in rows:
        experts = f"{r['num_experts']} top-{r['moe_router_topk']}" if r["num_experts"] else "-"
        params = _human(r["params"]) + ("*" if r["vocab_size"] is None else "")
        table.append((
            r["name"], str(r["num_layers"]), str(r["hidden_size"]),
            f"{r['num_attention_heads']}/{r['num_query_groups']}", str(r["ffn_hidden_size"]), experts,
            str(r["vocab_size"] or "-"), params,
            _human(r["published_params"]) if r["published_params"] else "-",
            f"{r['diff_percent']:+.2f}%" if r["diff_percent"] is not None else "-",
            _human(r["active_params"]) if r["active_params"] else "-",
            _human(r["published_active_params"]) if r["published_active_params"] else "-",
        ))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    print("* without embeddings: the vocabulary comes from the tokenizer.")
    print("active: the parameters one token uses (MoE: its top-k routed experts), input embedding included "
          "(DeepSeek-V2/V3 publish theirs without it); MFU counts the FLOPs of these only.")
    return 0


def _load_entry(command: str, module_name: str, function: str) -> Callable[..., Any]:
    """``module_name.function``, or ConfigError saying the command is not available in this installation."""
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise  # a missing dependency inside the module: a real error, keep its traceback
        raise ConfigError(f"the '{command}' command is not available ({module_name} is missing)") from None
    entry = getattr(module, function, None)
    if entry is None:
        raise ConfigError(f"the '{command}' command is not available ({module_name}.{function} is missing)")
    return entry


def _overview() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [f"usage: {PROG} <command> [flags]   ({PROG} <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {text}" for name, text in COMMANDS.items()]
    lines += ["", f"Multi-process: torchrun --nproc-per-node N -m {PROG} train ...  or  "
                  f"{PROG} train --nproc-per-node N ..."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``meshtron`` command; returns the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_overview())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"{PROG} {__version__}")
        return 0
    command, rest = args[0], args[1:]
    default_to_expandable_segments()  # before any CUDA use (meshtron.allocator)
    try:
        if command == "train":
            return train_main(rest)
        if command == "presets":
            return presets_main(rest)
        if command in EXTERNAL_COMMANDS:
            result = _load_entry(command, *EXTERNAL_COMMANDS[command])(rest)
            return result if isinstance(result, int) else 0
    except ConfigError as err:
        print(f"{PROG} {command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG} {command}: interrupted", file=sys.stderr)
        return 130
    close = difflib.get_close_matches(command, list(COMMANDS), n=1)
    hint = f"; did you mean '{close[0]}'?" if close else f" (see {PROG} --help)"
    print(f"{PROG}: error: unknown command '{command}'{hint}", file=sys.stderr)
    return 2
