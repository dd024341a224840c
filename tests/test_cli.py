"""The `meshtron` command line: flag parsing, YAML precedence, help groups, aliases, errors and the launcher."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from meshtron import cli, launcher, validation
from meshtron.cli import TOPICS, build_config, flag_specs, main, parse_train_args, train_parser
from meshtron.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
QUICKSTART_NOTICE = "meshtron train: note: no --model, data or --config given"


def run_meshtron(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m meshtron ARGS`` in a fresh process."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "meshtron", *args], capture_output=True, text=True, cwd=REPO,
                          env=full_env, timeout=120)


@pytest.fixture
def no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "_cuda_available", lambda: False)


# ---------------------------------------------------------------------------------------------
# Errors: one line on stderr, exit code 2, no traceback.
# ---------------------------------------------------------------------------------------------

def test_unknown_flag_suggests_closest_in_a_subprocess() -> None:
    result = run_meshtron("train", "--hiden-size", "4")
    assert result.returncode == 2
    assert result.stderr == "meshtron train: error: unknown flag --hiden-size; did you mean --hidden-size?\n"
    assert "Traceback" not in result.stderr + result.stdout


@pytest.mark.parametrize("argv,expected", [
    (["--hiden-size=4"], "unknown flag --hiden-size; did you mean --hidden-size?"),
    (["--tensor-parallel-size", "2"], "did you mean --tensor-model-parallel-size?"),
    (["--hidden"], "unknown flag --hidden; did you mean --hidden-size?"),  # no prefix matching
    (["--zzzzzz"], "unknown flag --zzzzzz (see meshtron train --help)"),
    (["stray"], "unexpected argument 'stray'"),
    (["--normalization", "rmsnorm2"], "--normalization: invalid value 'rmsnorm2' (did you mean RMSNorm?); "
                                      "valid: LayerNorm, RMSNorm"),
    (["--hidden-size", "abc"], "--hidden-size: expected an integer, got 'abc'"),
    (["--lr", "fast"], "--lr: expected a number, got 'fast'"),
    (["--nproc_per_node", "x"], "--nproc-per-node: expected an integer, got 'x'"),
    (["--model", "llama3-7b"], "--model: invalid value 'llama3-7b'"),
    (["--num-layers"], "--num-layers: expected one argument"),
])
def test_bad_arguments_are_one_line_errors(argv: list[str], expected: str, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtron train: error: ")
    assert expected in err
    assert err.count("\n") == 1


def test_validation_error_exits_2(capsys: pytest.CaptureFixture, no_cuda: None) -> None:
    assert main(["train", "--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err == ("meshtron train: error: --num-attention-heads (6) must be divisible by "
                   "--tensor-model-parallel-size (4)\n")


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """A case that wrongly passed validation would start a run: make that fail the test at once."""
    def refuse(*args: object) -> None:
        raise AssertionError("the configuration was accepted")

    monkeypatch.setattr(cli, "_load_entry", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)


# (argv, what the one-line message must say). Each is bad input that once went through silently or
# ended in a traceback: non-finite numbers, negative or zero sizes, empty paths.
BAD_VALUES = [
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--clip-grad", "nan"], "--clip-grad must be a finite number, got nan"),  # once: clipping silently off
    (["--clip-grad", "inf"], "--clip-grad must be a finite number, got inf"),
    (["--min-lr=-inf"], "--min-lr must be a finite number, got -inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--adam-eps", "inf"], "--adam-eps must be a finite number"),
    (["--init-method-std", "nan"], "--init-method-std must be a finite number"),
    (["--rotary-base", "inf"], "--rotary-base must be a finite number"),
    (["--lr-warmup-fraction", "nan"], "--lr-warmup-fraction must be a finite number"),
    (["--distributed-timeout-minutes", "inf"], "--distributed-timeout-minutes must be a finite number"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "inf"], "--moe-expert-capacity-factor must be a finite"),
    (["--split", "nan,1,1"], "--split 'nan,1,1': expected up to three finite numbers"),
    (["--split", "inf,1,1"], "--split 'inf,1,1'"),
    (["--data-path", "nan", "A"], "--data-path: weights must be finite numbers"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--num-experts", "4", "--moe-first-dense-layers", "-1"], "--moe-first-dense-layers must be >= 0, got -1"),
    (["--rope-original-max-position-embeddings", "0"], "--rope-original-max-position-embeddings must be positive"),
    (["--profile-ranks", "-1"], "--profile-ranks takes global rank numbers, got -1"),
    (["--save", ""], "--save: expected a directory, got an empty path"),
    (["--load", ""], "--load: expected a checkpoint directory, got an empty path"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2"],
     "--expert-tensor-parallel-size (2) must equal --tensor-model-parallel-size (1)"),
]


@pytest.mark.parametrize("argv,expected", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_are_one_line_errors_naming_the_flag(argv: list[str], expected: str, no_cuda: None,
                                                        no_training: None, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--device", "cpu", *argv]) == 2
    lines = capsys.readouterr().err.splitlines()
    # one line, after the quick-start notice where that job's defaults are in use (the notice comes first)
    assert len(lines) <= 2 and all(line.startswith(QUICKSTART_NOTICE) for line in lines[:-1]), lines
    assert lines[-1].startswith("meshtron train: error: ") and expected in lines[-1]


BAD_YAML = [
    ("lr: .nan\n", "--lr must be a finite number, got nan"),
    ("clip_grad: .inf\n", "--clip-grad must be a finite number, got inf"),
    ("micro_batch_size: [1, 2]\n", "micro_batch_size: expected an integer, got [1, 2] (flag --micro-batch-size)"),
    ("train_iters: 2.5\n", "train_iters: expected an integer, got 2.5 (flag --train-iters)"),
    ("data_path: {a: 1}\n", "data_path: expected a list of values, got a mapping"),
    ("data_path: [[a, b]]\n", "data_path: expected a flat list of values"),
    ("42\n", "must hold a mapping of field: value, not a int"),
    ("- lr: 1\n", "must hold a mapping of field: value, not a list"),
    ("lr: 0.1\nlr: 0.2\n", "line 2: invalid YAML (key 'lr' appears twice)"),
    ("hidden_size: 64\nhidden-size: 32\n", "--hidden-size is given twice (keys 'hidden_size' and 'hidden-size')"),
    ("seed: 1\x00\n", "invalid YAML (unacceptable character"),
]


@pytest.mark.parametrize("text,expected", BAD_YAML, ids=[t for t, _ in BAD_YAML])
def test_bad_yaml_is_a_one_line_error(tmp_path: Path, text: str, expected: str, no_cuda: None, no_training: None,
                                      capsys: pytest.CaptureFixture) -> None:
    config = write(tmp_path / "run.yaml", text)
    assert main(["train", "--device", "cpu", "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtron train: error: ") and err.count("\n") == 1, err
    assert expected in err


def test_yaml_that_is_not_utf8_names_the_file_and_byte(tmp_path: Path, no_training: None,
                                                       capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("num_layers: 2\n# caf\u00e9\n".encode("latin-1"))
    assert main(["train", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (f"meshtron train: error: --config: {path} is not UTF-8 text: byte 0xe9 at byte "
                                       f"offset 19 (line 2); save the file as UTF-8\n")
    path.write_bytes(b"\xef\xbb\xbfnum_layers: 3\n")  # a byte order mark is fine
    assert build_config(["--config", str(path)]).model.num_layers == 3


def test_unknown_command(capsys: pytest.CaptureFixture) -> None:
    assert main(["trian"]) == 2
    assert "unknown command 'trian'; did you mean 'train'?" in capsys.readouterr().err


def test_missing_command_module_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"the 'x' command is not available \(meshtron.not_a_module is missing\)"):
        cli._load_entry("x", "meshtron.not_a_module", "main")
    with pytest.raises(ConfigError, match=r"meshtron.cli.not_a_function is missing"):
        cli._load_entry("x", "meshtron.cli", "not_a_function")


def test_every_command_is_dispatched() -> None:
    assert set(cli.COMMANDS) == {"train", "presets"} | set(cli.EXTERNAL_COMMANDS)


def test_help_is_fast_and_does_not_import_torch() -> None:
    code = ("import sys; from meshtron.cli import build_config, train_parser; train_parser().format_help(); "
            "build_config(['--model', 'llama3-8b']); print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.stdout.strip() == "False", result.stderr
    top = run_meshtron("--help")
    assert top.returncode == 0 and all(c in top.stdout for c in cli.COMMANDS)


# ---------------------------------------------------------------------------------------------
# Help groups.
# ---------------------------------------------------------------------------------------------

def _group_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {s: g.title for g in parser._action_groups for a in g._group_actions for s in a.option_strings}


def test_help_is_grouped_by_topic() -> None:
    text = train_parser().format_help()
    for topic in TOPICS:
        assert f"\n{topic}:\n" in text
    group = _group_of(train_parser())
    expected = {
        "--num-layers": "Model", "--swiglu": "Model", "--num-experts": "Mixture of experts",
        "--moe-router-topk": "Mixture of experts", "--tensor-model-parallel-size": "Parallelism",
        "--sequence-parallel": "Parallelism", "--nproc-per-node": "Launcher", "--nnodes": "Launcher",
        "--rdzv-endpoint": "Launcher", "--lr": "Optimizer and learning rate", "--train-iters": "Training",
        "--bf16": "Precision and recomputation", "--fp8-hybrid": "Precision and recomputation",
        "--recompute-granularity": "Precision and recomputation", "--compile": "Precision and recomputation",
        "--data-path": "Data and tokenizer", "--save": "Checkpoints", "--metrics-file": "Logging",
        "--use-mcore-models": "Megatron compatibility", "--transformer-impl": "Checkpoints",
        "--use-flash-attn": "Megatron compatibility", "--dataloader-type": "Megatron compatibility",
        "--ckpt-format": "Megatron compatibility", "--cpu-optimizer-type": "Megatron compatibility",
        "--moe-grouped-gemm": "Megatron compatibility",
    }
    assert {flag: group[flag] for flag in expected} == expected


def test_train_help_in_a_subprocess() -> None:
    result = run_meshtron("train", "--help")
    assert result.returncode == 0
    assert "--hidden-size" in result.stdout and "Megatron compatibility:" in result.stdout


def test_every_field_has_a_flag() -> None:
    from meshtron.config import FIELD_SECTION
    from meshtron.megatron_compat import MEGATRON_COMPAT

    compat = {flag.name for flag in MEGATRON_COMPAT}
    assert not compat & set(FIELD_SECTION)  # accepted flags without effect have no configuration field
    assert {s.name for s in flag_specs()} == set(FIELD_SECTION) | compat
    assert all(s.help for s in flag_specs())


def test_compat_flags_stay_out_of_the_configuration(tmp_path) -> None:
    from meshtron.checkpoint.metadata import config_from_dict

    yaml_file = tmp_path / "megatron.yaml"
    yaml_file.write_text("use_flash_attn: true\ntransformer_impl: transformer_engine\nckpt_format: torch_dist\n")
    args = parse_train_args(["--config", str(yaml_file), "--use-mcore-models", "--no-rope-fusion",
                             "--timing-log-level", "2", "--hidden-size", "64", "--num-layers", "2",
                             "--num-attention-heads", "4"])
    assert {"use_flash_attn", "transformer_impl", "ckpt_format", "use_mcore_models", "no_rope_fusion",
            "timing_log_level"} <= set(args.given)
    saved = args.config.to_dict()
    assert not {"use_flash_attn", "use_mcore_models", "no_rope_fusion", "timing_log_level"} & set(saved)
    # A checkpoint's config.yaml written before these flags left the configuration still loads.
    reloaded = config_from_dict({**saved, "use_flash_attn": True, "ckpt_format": "torch_dist"}).to_dict()
    assert reloaded.keys() == saved.keys() and reloaded["hidden_size"] == 64
    with pytest.raises(ConfigError, match="--timing-log-level must be 0, 1 or 2"):
        parse_train_args(["--timing-log-level", "3"])
    with pytest.raises(ConfigError, match="--transformer-impl"):
        parse_train_args(["--transformer-impl", "te"])


# ---------------------------------------------------------------------------------------------
# Precedence: defaults < preset < YAML < flags.
# ---------------------------------------------------------------------------------------------

def write(path: Path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_flags_override_yaml_override_preset(tmp_path: Path) -> None:
    config = write(tmp_path / "run.yaml", """
        model: gpt2-small
        num_layers: 3
        seq-length: 256      # dashed keys work too
        lr: 1e-3             # YAML 1.1 reads this as a string; it is converted
        mock_data: true
        data_path: null
    """)
    cfg = build_config(["--config", config, "--num-layers", "5"])
    assert cfg.model.num_layers == 5            # flag over YAML
    assert cfg.model.seq_length == 256          # YAML over preset (1024)
    assert cfg.model.hidden_size == 768         # preset over dataclass default (64)
    assert cfg.model.hidden_dropout == 0.0      # preset over dataclass default (0.1)
    assert cfg.model.normalization == "LayerNorm"
    assert cfg.optim.lr == pytest.approx(1e-3)
    assert cfg.data.mock_data is True and cfg.data.data_path == []
    assert cfg.model.model == "gpt2-small"


def test_model_flag_overrides_yaml_model(tmp_path: Path) -> None:
    config = write(tmp_path / "run.yaml", "model: gpt2-small\nhidden_size: 1024\n")
    cfg = build_config(["--config", config, "--model", "llama3-8b"])
    assert cfg.model.model == "llama3-8b"
    assert cfg.model.num_layers == 32           # from the flag's preset
    assert cfg.model.hidden_size == 1024        # YAML still overrides the preset's field


def test_tiny_preset_is_the_default() -> None:
    cfg = build_config([])
    assert cfg.model.model == "tiny" and cfg.model.normalization == "RMSNorm"
    assert build_config(["--seq-length", "64"]).model.model == "tiny"
    explicit = build_config(["--hidden-size", "32"])  # a shape flag: no preset, dataclass defaults
    assert explicit.model.model is None and explicit.model.normalization == "LayerNorm"


def test_quickstart_defaults_stay_put_when_one_flag_is_added(capsys: pytest.CaptureFixture) -> None:
    from meshtron.cli import parse_train_args, quickstart_notice
    from meshtron.presets import QUICKSTART

    plain, one_flag = build_config([]), build_config(["--train-iters", "50"])
    for section in ("model", "train", "optim", "checkpoint", "log"):
        a, b = getattr(plain, section), getattr(one_flag, section)
        differing = {k for k in vars(a) if getattr(a, k) != getattr(b, k)}
        assert differing == ({"train_iters"} if section == "train" else set()), section
    assert one_flag.train.train_iters == 50 and one_flag.model.seq_length == QUICKSTART["seq_length"]
    assert one_flag.checkpoint.save == QUICKSTART["save"]
    notice = quickstart_notice(parse_train_args(["--train-iters", "50", "--save", "elsewhere"]))
    assert "--seq-length 256" in notice and "--train-iters" not in notice and "--save" not in notice
    # a model, data or a config file describes another job: the quick-start settings stay out of it
    for argv in (["--mock-data"], ["--model", "gpt2-small"], ["--num-layers", "2"], ["--data-path", "x"]):
        args = parse_train_args(argv)
        assert args.quickstart_defaults == () and quickstart_notice(args) is None, argv
        assert args.config.train.train_iters != QUICKSTART["train_iters"], argv


def test_yaml_shape_disables_default_preset(tmp_path: Path) -> None:
    config = write(tmp_path / "run.yaml", "num_layers: 2\n")
    assert build_config(["--config", config]).model.model is None


@pytest.mark.parametrize("text,expected", [
    ("hiden_size: 4\n", "unknown key 'hiden_size'; did you mean hidden_size?"),
    ("hidden_size: big\n", "hidden_size: expected an integer, got 'big'"),
    ("normalization: Foo\n", "normalization: invalid value 'Foo'"),
    ("swiglu: maybe\n", "swiglu: expected true or false"),
    ("- a\n- b\n", "must hold a mapping"),
    ("a: [\n", "invalid YAML"),
])
def test_yaml_errors_name_the_file(tmp_path: Path, text: str, expected: str) -> None:
    config = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as info:
        build_config(["--config", config])
    assert expected in str(info.value) and "bad.yaml" in str(info.value)


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"--config: file .*nope.yaml does not exist"):
        build_config(["--config", str(tmp_path / "nope.yaml")])


# ---------------------------------------------------------------------------------------------
# Booleans and aliases.
# ---------------------------------------------------------------------------------------------

def test_boolean_flags_and_negations() -> None:
    assert build_config(["--no-swiglu"]).model.swiglu is False                  # tiny has SwiGLU
    assert build_config(["--swiglu", "--hidden-size", "64"]).model.swiglu is True
    assert build_config(["--compile"]).train.compile is True                    # Optional[bool]
    assert build_config(["--no-compile"]).train.compile is False
    assert build_config([]).train.compile is None
    assert build_config(["--no-load-optim"]).checkpoint.no_load_optim is True  # a field named no_...
    assert build_config(["--no-generate-sample"]).train.generate_sample is False


def test_aliases() -> None:
    assert build_config(["--fp8-hybrid"]).train.fp8_hybrid is True
    assert build_config(["--cpu-optimizer"]).optim.optimizer_cpu_offload is True
    assert build_config(["--cpu-optimizer", "--no-cpu-optimizer"]).optim.optimizer_cpu_offload is False
    for argv in (["--nproc_per_node", "2"], ["--nproc_per_node=2"], ["--nproc-per-node", "2"]):
        assert build_config(argv).launcher.nproc_per_node == 2
    cfg = build_config(["--node_rank", "1", "--master_addr", "h", "--master_port", "1234", "--rdzv_backend", "c10d",
                        "--rdzv_endpoint", "h:1", "--nnodes=2"])
    p = cfg.launcher
    assert (p.node_rank, p.master_addr, p.master_port, p.rdzv_backend, p.rdzv_endpoint, p.nnodes) == \
        (1, "h", 1234, "c10d", "h:1", "2")


def test_launcher_settings_are_not_the_runs() -> None:
    from meshtron.launcher import LAUNCHER_FIELDS

    cfg = build_config(["--nproc-per-node", "2", "--max-restarts", "3", "--master-port", "1234"])
    assert (cfg.launcher.nproc_per_node, cfg.launcher.max_restarts) == (2, 3)
    assert not set(LAUNCHER_FIELDS) & set(cfg.to_dict())  # a checkpoint's config.yaml does not list them
    assert not set(LAUNCHER_FIELDS) & {f.name for f in dataclasses.fields(type(cfg.parallel))}


def test_choices_are_case_insensitive() -> None:
    assert build_config(["--lr-decay-style", "wsd"]).optim.lr_decay_style == "WSD"


# ---------------------------------------------------------------------------------------------
# Megatron-Core user guide: every flag of its commands is accepted.
# ---------------------------------------------------------------------------------------------

# Every flag that appears in the commands of the Megatron-Core user guide our users arrive with, with a value.
MEGATRON_GUIDE_FLAGS = [
    ("--nproc_per_node=8", None), ("--nnodes=8", None),
    ("--tensor-model-parallel-size", "4"), ("--pipeline-model-parallel-size", "4"), ("--context-parallel-size", "1"),
    ("--expert-model-parallel-size", "4"), ("--sequence-parallel", None), ("--num-layers", "80"),
    ("--hidden-size", "8192"), ("--num-attention-heads", "64"), ("--seq-length", "4096"),
    ("--max-position-embeddings", "4096"), ("--micro-batch-size", "1"), ("--global-batch-size", "1024"),
    ("--lr", "3e-4"), ("--train-iters", "100000"), ("--lr-decay-style", "cosine"), ("--lr-warmup-iters", "2000"),
    ("--weight-decay", "0.1"), ("--clip-grad", "1.0"), ("--bf16", None), ("--use-mcore-models", None),
    ("--transformer-impl", "transformer_engine"), ("--data-path", "/path/to/data"),
    ("--vocab-file", "/path/to/vocab.json"), ("--merge-file", "/path/to/merges.txt"), ("--num-experts", "8"),
    ("--moe-router-topk", "2"), ("--moe-router-load-balancing-type", "aux_loss"), ("--moe-aux-loss-coeff", "0.01"),
    ("--use-flash-attn", None), ("--fp8-hybrid", None), ("--recompute-granularity", "full"),
    ("--recompute-method", "block"), ("--recompute-num-layers", "1"), ("--cpu-optimizer", None),
    ("--cpu-optimizer-type", "ADAM"), ("--num-layers-per-virtual-pipeline-stage", "2"),
    ("--dataloader-type", "cyclic"), ("--init-method-std", "0.006"), ("--attention-dropout", "0.0"),
    ("--hidden-dropout", "0.0"),
]


@pytest.mark.parametrize("flag,value", MEGATRON_GUIDE_FLAGS, ids=[f for f, _ in MEGATRON_GUIDE_FLAGS])
def test_megatron_guide_flag_is_accepted(flag: str, value: str | None) -> None:
    args = parse_train_args([flag] + ([value] if value is not None else []))
    assert len(args.given) == 1


def _fake_data(tmp_path: Path) -> dict[str, str]:
    for name in ("data.bin", "data.idx", "vocab.json", "merges.txt"):
        (tmp_path / name).write_text("")
    return {"/path/to/data": str(tmp_path / "data"), "/path/to/vocab.json": str(tmp_path / "vocab.json"),
            "/path/to/merges.txt": str(tmp_path / "merges.txt")}


def test_megatron_guide_70b_script_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guide's train_llama_70b.sh with `meshtron train` in place of `torchrun ... pretrain_gpt.py`."""
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)
    paths = _fake_data(tmp_path)
    argv = """--nproc_per_node=8 --nnodes=8
      --tensor-model-parallel-size 4 --pipeline-model-parallel-size 4 --context-parallel-size 1 --sequence-parallel
      --num-layers 80 --hidden-size 8192 --num-attention-heads 64 --seq-length 4096 --max-position-embeddings 4096
      --micro-batch-size 1 --global-batch-size 1024 --lr 3e-4 --train-iters 100000 --lr-decay-style cosine
      --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0 --bf16 --use-mcore-models
      --transformer-impl transformer_engine --data-path /path/to/data --vocab-file /path/to/vocab.json
      --merge-file /path/to/merges.txt""".split()
    args = parse_train_args([paths.get(a, a) for a in argv])
    cfg = args.config
    assert launcher.planned_world_size(cfg.launcher) == 64
    validation.validate_config(cfg, 64)
    assert validation.data_parallel_size(cfg, 64) == 4
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"
    notices = cli.compat_notices(args)
    assert [n.split(":")[2].strip() for n in notices] == ["--use-mcore-models"]


def test_megatron_guide_moe_command_validates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)
    paths = _fake_data(tmp_path)
    argv = """--nproc_per_node=8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1
      --expert-model-parallel-size 4 --num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
      --moe-aux-loss-coeff 0.01 --hidden-size 4096 --num-layers 32 --num-attention-heads 32 --seq-length 4096
      --max-position-embeddings 4096 --bf16 --use-mcore-models --transformer-impl transformer_engine
      --data-path /path/to/data --vocab-file /path/to/vocab.json --merge-file /path/to/merges.txt""".split()
    cfg = build_config([paths.get(a, a) for a in argv])
    validation.validate_config(cfg, 8)
    assert cfg.model.num_experts == 8 and cfg.parallel.expert_model_parallel_size == 4


# ---------------------------------------------------------------------------------------------
# Presets command.
# ---------------------------------------------------------------------------------------------

def test_presets_table(capsys: pytest.CaptureFixture) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("llama3-8b "))
    assert row.split() == ["llama3-8b", "32", "4096", "32/8", "14336", "-", "128256", "8.03B", "8.03B", "+0.00%", "-", "-"]


def test_presets_json(capsys: pytest.CaptureFixture) -> None:
    assert main(["presets", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["gpt2-small"]["params"] == 124_439_808
    assert all(abs(r["diff_percent"]) < 1.0 for r in rows.values() if r["published_params"])


# ---------------------------------------------------------------------------------------------
# Launcher.
# ---------------------------------------------------------------------------------------------

def test_strip_launcher_flags() -> None:
    argv = ["--nproc_per_node=8", "--nnodes", "2", "--hidden-size", "64", "--rdzv-endpoint", "h:1", "--node_rank=1",
            "--master-addr", "a", "--master_port", "1", "--rdzv_backend", "c10d", "--bf16"]
    assert launcher.strip_launcher_flags(argv) == ["--hidden-size", "64", "--bf16"]


def test_torchrun_args() -> None:
    cfg = build_config(["--nproc-per-node", "8", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                        "head:29500"])
    args = launcher.torchrun_args(cfg.launcher, ["-m", "meshtron", "train", "--bf16"])
    assert args == ["--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                    "--master-port", "29500", "--rdzv-backend", "c10d", "--max-restarts", "0",
                    "--rdzv-endpoint", "head:29500", "-m", "meshtron", "train", "--bf16"]


def test_launcher_flags_ignored_under_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = build_config(["--nproc-per-node", "2"])
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launcher.should_launch(cfg.launcher)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not launcher.should_launch(cfg.launcher)
    assert launcher.env_world_size() == 2


def test_launcher_validates_before_starting_workers() -> None:
    """A layout that cannot fit the requested processes fails once, in the launching process."""
    result = run_meshtron("train", "--nproc-per-node", "2", "--tensor-model-parallel-size", "4", "--device", "cpu")
    assert result.returncode == 2
    notice, error = result.stderr.splitlines()  # the quick-start notice first, then the one error line
    assert notice.startswith(QUICKSTART_NOTICE)
    assert error == ("meshtron train: error: world size 2 is not divisible by TP(4) x CP(1) x PP(1) = 4: "
                     "choose --tensor-model-parallel-size, --context-parallel-size and "
                     "--pipeline-model-parallel-size whose product divides 2")


def test_elastic_nnodes_has_no_planned_world_size() -> None:
    assert launcher.planned_world_size(build_config(["--nproc-per-node", "4", "--nnodes", "1:2"]).launcher) is None
    assert launcher.planned_world_size(build_config(["--nproc-per-node", "4", "--nnodes", "3"]).launcher) == 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_starts_workers_with_the_launch_environment(tmp_path: Path) -> None:
    """The shortcut's torch.distributed.run arguments start N workers that see RANK and WORLD_SIZE."""
    script = tmp_path / "worker.py"
    script.write_text("import os, sys\n"
                      "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write("
                      "os.environ['WORLD_SIZE'] + ' ' + os.environ['LOCAL_RANK'] + ' ' + ' '.join(sys.argv[2:]))\n")
    cfg = build_config(["--nproc-per-node", "2", "--master-port", str(_free_port())])
    code = launcher.run_torchrun(launcher.torchrun_args(cfg.launcher, [str(script), str(tmp_path), "--bf16"]))
    assert code == 0
    assert sorted(p.read_text() for p in tmp_path.glob("rank*")) == ["2 0 --bf16", "2 1 --bf16"]


def test_torchrun_failure_returns_the_worker_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import sys\nsys.exit(3)\n")
    cfg = build_config(["--nproc-per-node", "1", "--master-port", str(_free_port())])
    assert launcher.run_torchrun(launcher.torchrun_args(cfg.launcher, [str(script)])) == 3
    assert "worker process(es) failed" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# docs/cli.md stays generated from the config.
# ---------------------------------------------------------------------------------------------

def test_cli_doc_is_up_to_date() -> None:
    spec = importlib.util.spec_from_file_location("gen_cli_doc", REPO / "scripts" / "gen_cli_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (REPO / "docs" / "cli.md").read_text() == module.render(), \
        "docs/cli.md is stale: run `python scripts/gen_cli_doc.py`"


# ---------------------------------------------------------------------------------------------
# `meshtron train` hands a validated config to the trainer and reports its errors.
# ---------------------------------------------------------------------------------------------

class TrainingError(RuntimeError):
    """Stands in for the trainer's own error class (looked up in the trainer's module)."""


def _fake_trainer(monkeypatch: pytest.MonkeyPatch, behaviour) -> list:
    seen: list = []

    def run_training(cfg, layout=None):
        seen.append(cfg)
        return behaviour(cfg)

    monkeypatch.setattr(cli, "_load_entry", lambda command, module, function: run_training)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    return seen


def test_train_passes_a_validated_config(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                         no_cuda: None) -> None:
    seen = _fake_trainer(monkeypatch, lambda cfg: object())
    assert main(["train", "--micro-batch-size", "4", "--use-flash-attn"]) == 0
    (cfg,) = seen
    # the quick-start job with micro batches of 4: its global batch of 8 stays
    assert (cfg.train.device, cfg.train.global_batch_size, cfg.model.model) == ("cpu", 8, "tiny")
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(QUICKSTART_NOTICE) and len(err) == 2  # the quick-start notice first
    assert err[1] == ("meshtron train: note: --use-flash-attn: Accepted for Megatron compatibility "
                      "(flash/cuDNN attention is the default on CUDA).")


@pytest.mark.parametrize("error,code", [(ConfigError("--data-path: x.bin does not exist"), 2),
                                        (TrainingError("5 non-finite steps in a row"), 1)])
def test_train_errors_during_the_run(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, no_cuda: None,
                                     error: Exception, code: int) -> None:
    def fail(cfg, layout=None):
        raise error

    _fake_trainer(monkeypatch, fail)
    fail.__module__ = __name__  # the module whose TrainingError counts as a user-facing error
    monkeypatch.setattr(cli, "_load_entry", lambda *a: fail)
    assert main(["train"]) == code
    assert capsys.readouterr().err.splitlines()[-1] == f"meshtron train: error: {error}"


def test_validation_error_is_reported_by_rank_zero_only(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "3")
    assert main(["train", "--tensor-model-parallel-size", "4"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["train", "--tensor-model-parallel-size", "4"]) == 2
    assert "world size 6 is not divisible" in capsys.readouterr().err


def test_use_checkpoint_args_with_a_damaged_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture
                                                                  ) -> None:
    (tmp_path / "latest").write_text("not a number\n")
    assert main(["train", "--load", str(tmp_path), "--use-checkpoint-args"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshtron train: error: --use-checkpoint-args: ")
    assert "should hold an iteration number" in err[0]


# ---------------------------------------------------------------------------------------------
# Issue 37: what the help says, Megatron no-ops that would change what a user gets, launcher values.
# ---------------------------------------------------------------------------------------------

def test_overview_says_convert_is_hugging_face_conversion(capsys: pytest.CaptureFixture) -> None:
    """Resharding happens when any checkpoint loads into another layout; `convert` is HF import/export."""
    assert main(["--help"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("convert")]
    assert "Hugging Face" in line and "resharding" not in line


@pytest.mark.parametrize("argv,expected", [
    (["--dataloader-type", "external"], "--dataloader-type external: an external data loader comes from a "
                                        "training script of one's own"),
    (["--ckpt-format", "torch"], "--ckpt-format torch: Megatron's legacy per-rank torch checkpoints are not "
                                 "written or read by meshtron"),
    (["--offload-activations", "--offload-modules", "core_attn", "embedding"],
     "--offload-modules: invalid value 'embedding'; valid: attn_norm, qkv_linear, core_attn"),
    (["--accumulate-allreduce-grads-in-fp32", "--grad-reduce-in-bf16"],
     "--accumulate-allreduce-grads-in-fp32 asks for fp32 gradient reduction and --grad-reduce-in-bf16 for bf16"),
    (["--nproc-per-node", "0"], "--nproc-per-node must be a whole number >= 1"),
])
def test_megatron_values_meshtron_cannot_honour_are_refused(argv: list[str], expected: str, no_cuda: None,
                                                           no_training: None, capsys: pytest.CaptureFixture) -> None:
    assert main(["train", "--mock-data", "--vocab-size", "64", *argv]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("meshtron train: error: " + expected.split(":")[0]) and expected in line, line


def test_offload_modules_from_yaml_are_checked_too(tmp_path: Path) -> None:
    config = write(tmp_path / "run.yaml", "offload_activations: true\noffload_modules: [core_attn, bogus]\n")
    with pytest.raises(ConfigError, match="offload_modules: invalid value 'bogus'"):
        parse_train_args(["--config", config])


def test_offload_modules_warns_in_capitals_and_cyclic_is_a_note(monkeypatch: pytest.MonkeyPatch, no_cuda: None,
                                                                capsys: pytest.CaptureFixture) -> None:
    _fake_trainer(monkeypatch, lambda cfg: 0)
    argv = ["train", "--mock-data", "--vocab-size", "64", "--offload-activations", "--offload-modules", "core_attn",
            "expert_fc1", "--dataloader-type", "cyclic", "--device", "cpu"]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("meshtron train: note: --dataloader-type cyclic: Accepted for Megatron compatibility")
    assert err[1].startswith("meshtron train: WARNING: --offload-modules core_attn expert_fc1: meshtron does not "
                             "offload single modules") and len(err) == 2


def test_data_path_items_with_spaces_stay_whole(tmp_path: Path, no_cuda: None) -> None:
    """A prefix with a space, on the command line and as a YAML list item or string, is one path."""
    spaced = tmp_path / "my corpus" / "text_document"
    spaced.parent.mkdir()
    for suffix in (".bin", ".idx"):
        Path(str(spaced) + suffix).write_bytes(b"")
    other = tmp_path / "other"
    for suffix in (".bin", ".idx"):
        Path(str(other) + suffix).write_bytes(b"")
    common = ["--vocab-file", write(tmp_path / "v.json", "{}"), "--merge-file", write(tmp_path / "m.txt", ""),
              "--device", "cpu"]
    cfg = build_config(["--data-path", str(spaced), *common])
    assert cfg.data.data_path == [str(spaced)]
    assert validation.parse_data_path(cfg.data.data_path) == [(None, str(spaced))]
    validation.validate_config(cfg, 1)  # the files are found: the path was not split at its space
    config = write(tmp_path / "run.yaml", f'data_path: ["0.7 {spaced}", "0.3 {other}"]\n')
    cfg = build_config(["--config", config, *common])
    assert validation.parse_data_path(cfg.data.data_path) == [(0.7, str(spaced)), (0.3, str(other))]
    validation.validate_config(cfg, 1)
    config = write(tmp_path / "one.yaml", f"data_path: {spaced}\n")  # a YAML string: one item too
    assert build_config(["--config", config, *common]).data.data_path == [str(spaced)]


def test_vocab_size_below_the_tokenizers_is_refused_through_the_cli(tmp_path: Path, no_cuda: None,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture) -> None:
    """The built-in corpus's tokenizer has 2,048 tokens: --vocab-size 100 was silently replaced by it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--vocab-size", "100", "--train-iters", "1", "--no-generate-sample"]) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("meshtron train: error: --vocab-size 100 is smaller than the tokenizer's vocabulary of "
                            "2048 tokens"), error
