"""Write docs/cli.md, the reference of every `meshtron train` flag, from the configuration dataclasses and the
Megatron compatibility flags.

Usage: python scripts/gen_cli_doc.py [--check]
(--check exits 1 when docs/cli.md differs from what the config describes.)
"""

from __future__ import annotations

import sys
from pathlib import Path

from meshtron.flags import FlagSpec, flag_groups, metavar_of

DOC = Path(__file__).resolve().parents[1] / "docs" / "cli.md"

INTRO = """\
# `meshtron train` flags

Generated from `meshtron/config.py` and `meshtron/megatron_compat.py` by `python scripts/gen_cli_doc.py`; do not
edit by hand.
`meshtron train --help` prints the same flags.

- Flag names are Megatron-LM's: every configuration field `hidden_size` is the flag `--hidden-size`.
- A YAML file given with `--config FILE.yaml` holds `field: value` pairs with the same names
  (`hidden_size: 4096`, or the dashed `hidden-size: 4096`). An unknown key is an error that suggests the closest one.
- Precedence, lowest first: the defaults below, the `--model` preset, the YAML file, the command line.
  Without `--model` and without any of `--num-layers`, `--hidden-size`, `--num-attention-heads`,
  the `tiny` preset is used.
- Boolean flags: `--flag` sets it, `--no-flag` clears it (YAML: `flag: true` / `flag: false`).
- List flags (`--data-path`) take several values: `--data-path 0.7 A 0.3 B` (YAML: a list or a string). A dataset
  path item stays whole, so a path may hold spaces (`--data-path "/data/my corpus/text"`, or one YAML list item);
  an item whose first word is a number is weighted: `"0.7 /data/my corpus/text"` is one pair, `"0.7 A 0.3 B"` a
  whole blend.
- Errors (unknown flag, bad value, impossible layout, missing file) are one line naming the flag, exit code 2.
- The Megatron compatibility flags are accepted so that Megatron scripts run unchanged; meshtron prints a one-line
  note when one is given. A value that would quietly give a Megatron user something else is refused, exit 2
  (`--dataloader-type external`, `--ckpt-format torch`, `--accumulate-allreduce-grads-in-fp32` with bf16 gradient
  reduction), or, where the run still gives what was asked in another way, named in a `WARNING` line
  (`--offload-modules`). They are not part of the run's configuration: a checkpoint's `config.yaml` does not list
  them.

## How a configuration is checked

Before any work starts (and before `--nproc-per-node` starts any worker), `meshtron.validation.validate_config`
runs two steps; neither needs torch or the model code.

1. `resolve(cfg, world_size)` fills what other flags imply: `--max-position-embeddings` from `--seq-length`,
   `--num-query-groups`, `--ffn-hidden-size`, `--moe-ffn-hidden-size`, `--expert-tensor-parallel-size` (TP),
   the virtual stages from `--num-layers-per-virtual-pipeline-stage`, `--device`, `--bf16`/`--fp32`,
   `--fp8-format` from `--fp8-hybrid`, `--compile`, `--recompute-method`, `--global-batch-size`
   (micro batch x data-parallel size), iterations from `--train-samples`, `--lr-warmup-samples` and
   `--lr-decay-samples`, `--lr-decay-iters` (`--train-iters`), `--tokenizer-type` from `--vocab-file` and
   `--merge-file`. Resolving twice gives the same configuration.
2. `check(cfg, world_size)` changes nothing and stops at the first violated rule with one line that names the flag.

Which module owns which rule:

| Rule | Module |
|---|---|
| a value's type, choices and encoding; unknown flags and YAML keys; a YAML key given twice | `meshtron.cli` |
| every number finite (infinity only where a field allows it: `--exit-duration-in-mins inf` means never) | `meshtron.validation` |
| model shape; sizes against the shape; world size = TP x CP x DP x PP; experts against EP (and ETP = TP); batch sizes; precision; recomputation; optimizer and schedule; data, tokenizer, checkpoint and logging paths | `meshtron.validation` (the process groups reuse its world-size rule) |
| layers over pipeline stages and virtual stages; micro-batches of the interleaved schedule | `meshtron.pipeline.partition` (plain integers, called by validation) |
| `--nnodes`, `--node-rank`, `--master-port` and the other launcher flags | `meshtron.launcher.check_launcher` (called by validation) |
| the hang, restart, fault-drill, straggler, re-run and weight-hash flags | `meshtron.resilience.checks`, `meshtron.resilience.detection_checks` (called by validation) |
| facts known only later: GPUs on the node, a checkpoint's contents, a dataset's tokens | the launcher, `meshtron.checkpoint`, `meshtron.data` |
"""

#: The last section of docs/cli.md: what a run's exit code says (DESIGN.md section 11).
EXIT_CODES = """
## Exit codes and signals

| Code | Meaning |
|---|---|
| 0 | Training finished, or stopped as asked: `--exit-interval`, `--exit-duration-in-mins`, or SIGTERM with `--exit-signal-handler` once every rank has saved its checkpoint. |
| 1 | A failure while running: repeated non-finite losses, a rank that lost its peer, a failed save, or a bug (then with its traceback). |
| 2 | Bad input: a flag, a file, a dataset or a checkpoint that does not fit; also when it is found on one rank only after the process groups exist (the line names the rank: `[rank 3] ...`). |
| 128+n | Ended by signal n: 130 for Ctrl-C (SIGINT), 143 for SIGTERM without `--exit-signal-handler`, 137 for SIGKILL (e.g. the out-of-memory killer). |

One process and the `--nproc-per-node` launcher give the same codes. The launcher returns 0 when every
worker finished, 2 when any worker found bad input (the other workers' failures follow from it), else the
first failed worker's code, a death by signal n counted as 128+n. A signal the launcher receives
(SIGTERM, SIGINT, SIGHUP, SIGQUIT) is forwarded to its workers by torch.distributed.run; the launcher then
exits 0 when each of them saved and exited cleanly (SIGTERM with `--exit-signal-handler`), else 128+n,
with one line and no traceback. Between the forwarded signal and SIGKILL the workers have
`TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (default 30): set it above the time one iteration and a save take.
Under plain `torchrun` each worker exits with the same codes; torchrun's own exit code and output are its own.

Without `--exit-signal-handler`, SIGTERM ends a worker at once; `latest` still names the last complete
checkpoint. Every other way out (the end of training, an error, bad input, Ctrl-C, the signal handler's save)
tears down in order before the interpreter exits: the data prefetch threads are joined, an asynchronous save
in flight is waited for, the process groups are destroyed (subgroups first, the default group last) and
collected, so that no communication thread outlives the interpreter, and the output is flushed. Each step is
bounded by `--distributed-timeout-minutes`, so that a dead peer cannot hang the exit; a step that runs out
makes the process leave at once with its exit code.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _flags(spec: FlagSpec) -> str:
    value = "" if spec.kind is bool else " " + metavar_of(spec)
    if spec.nargs == "+":
        value += " ..."
    shown = [f"`{spec.flag}{value}`"] + [f"`{s}`" for s in spec.option_strings[1:]]
    shown += [f"`{s}`" for s in spec.negative_strings]
    return "<br>".join(shown)


def _default(spec: FlagSpec) -> str:
    if spec.default in (None, [], ""):
        return ""
    return f"`{spec.default}`"


def render() -> str:
    """The whole of docs/cli.md."""
    out = [INTRO]
    for topic, specs in flag_groups():
        out.append(f"\n## {topic}\n\n| Flag | Default | Description |\n|---|---|---|\n")
        for spec in specs:
            help_text = spec.help.replace("%%", "%")  # argparse-escaped percent signs
            out.append(f"| {_flags(spec)} | {_default(spec)} | {_cell(help_text)} |\n")
    out.append(EXIT_CODES)
    return "".join(out)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python scripts/gen_cli_doc.py", file=sys.stderr)
            return 1
        return 0
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
