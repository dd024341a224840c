"""Megatron-LM checkpoints read by meshtron: megatron-core's logits, merged shards, optimizer state, refusals.

The fixtures under tests/fixtures/megatron/ were written by megatron-core 0.19.2 itself
(tests/fixtures/megatron/make_checkpoints.py): TP=2 x PP=2 torch_dist with fully reshardable optimizer state,
the same with ``common.pt``, the same model in the legacy format, an expert-parallel MoE model, a model with
multi-latent attention (DeepSeek's, with latent norms: ``--qk-layernorm``; its rotary rows reordered on reading),
and a model with two multi-token prediction depths at TP=2 x PP=2 in torch_dist and legacy.
``reference.pt`` holds megatron-core's logits of each after it loaded the checkpoint into a TP=1, PP=1 model, and
for the multi-token prediction models its main and depth losses on one batch.
"""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from meshtron.checkpoint import load_for_inference
from meshtron.checkpoint.convert import convert_main
from meshtron.checkpoint.errors import CheckpointError
from meshtron.checkpoint.megatron import find_megatron_checkpoint, looks_like_megatron
from meshtron.checkpoint.megatron.args import check_model
from meshtron.checkpoint.megatron.reader import read_megatron
from meshtron.checkpoint.megatron.unpickler import load_pickled
from meshtron.config import ModelConfig
from tests.checkpoint.ckpt_helpers import mtp_losses

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron"
MTP_CASES = ("mtp_tp2pp2", "legacy_mtp_tp2pp2")
CASES = ("dense_tp2pp2", "dense_tp2pp2_common_pt", "legacy_tp2pp2", "moe_ep2", "mla") + MTP_CASES


@pytest.fixture(scope="module")
def reference():
    return torch.load(FIXTURES / "reference.pt", weights_only=True)


def _state(name: str, **kw):
    return read_megatron(find_megatron_checkpoint(FIXTURES / name), **kw)


@pytest.mark.parametrize("name", CASES)
def test_converted_logits_equal_megatron_core(name, tmp_path, reference, capsys):
    assert convert_main(["--from", "megatron", "--input", str(FIXTURES / name), "--output", str(tmp_path / "c")]) == 0
    model, _ = load_for_inference(tmp_path / "c", "cpu", torch.float32)
    with torch.no_grad():
        logits = model(reference["tokens"])
    torch.testing.assert_close(logits, reference["logits"][name], rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", MTP_CASES)
def test_converted_mtp_losses_equal_megatron_core(name, tmp_path, reference):
    """Two prediction depths (TP=2 x PP=2, on the last stage beside the embedding's copy): converted, the model's
    main loss and each depth's loss are megatron-core's (fp32), with its flags: --mtp-num-layers 2, the loss weight
    0.3 and --mtp-normed-hidden-states (megatron-core's depths read the hidden states after the final norms)."""
    from meshtron.checkpoint.metadata import read_config

    assert convert_main(["--from", "megatron", "--input", str(FIXTURES / name), "--output", str(tmp_path / "c")]) == 0
    m = read_config(next((tmp_path / "c").glob("iter_*"))).model
    assert (m.mtp_num_layers, m.mtp_loss_scaling_factor, m.mtp_normed_hidden_states) == (2, 0.3, True)
    model, _ = load_for_inference(tmp_path / "c", "cpu", torch.float32)
    main, depths = mtp_losses(model, reference["mtp_batch"])
    want = reference["mtp_losses"][name]
    torch.testing.assert_close(main, want["loss"], rtol=0, atol=2e-5)
    torch.testing.assert_close(depths, want["depths"], rtol=0, atol=2e-5)
    assert abs(float(depths[0] - depths[1])) > 1e-3  # two depths that differ: each compared


def test_converted_depths_keep_megatron_cores_computation(tmp_path):
    """The converted checkpoint records --mtp-normed-hidden-states in its model signature: a run of the same
    shapes whose depths would read the hidden states before the norms is refused, naming the flag."""
    from meshtron.checkpoint import load_checkpoint
    from meshtron.checkpoint.metadata import read_config
    from meshtron.model import GPTModel
    from meshtron.parallel.context import ParallelContext
    from meshtron.parallel.sharding import initialize_parameters

    assert convert_main(["--from", "megatron", "--input", str(FIXTURES / "mtp_tp2pp2"), "--output",
                         str(tmp_path / "c"), "--no-optimizer"]) == 0
    cfg = read_config(next((tmp_path / "c").glob("iter_*")))
    cfg.model.mtp_normed_hidden_states = False
    model = GPTModel(cfg.model, ParallelContext(), cfg.model.vocab_size)
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(tmp_path / "c"), [model], None, ParallelContext(), cfg)
    assert any("--mtp-normed-hidden-states" in d and "checkpoint True, this run False" in d
               for d in err.value.differences), err.value.differences


def test_mtp_names_and_flags():
    """megatron-core saves each depth under its own number (not stacked like the decoder's layers): enorm, hnorm,
    eh_proj [H, 2H] (column-parallel: TP=2 shards merged by rows), the transformer layer's tensors and
    final_layernorm become meshtron's mtp.layers.k.*; a run is checked against the checkpoint's depths."""
    state = _state("mtp_tp2pp2", optimizer=False)
    names = {k for k in state.model if k.startswith("mtp.")}
    for k in (0, 1):
        for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "final_norm.weight",
                  "transformer_layer.attention.q.weight", "transformer_layer.mlp.gate.weight",
                  "transformer_layer.input_norm.weight", "transformer_layer.post_attention_norm.weight"):
            assert f"mtp.layers.{k}.{n}" in names, n
    assert state.model["mtp.layers.1.eh_proj.weight"].shape == (16, 32)
    raw = {"mtp.layers.1.eh_proj.weight": torch.empty(16, 32)}
    dcp.load(raw, checkpoint_id=str(FIXTURES / "mtp_tp2pp2" / "iter_0000007"), no_dist=True)
    assert torch.equal(state.model["mtp.layers.1.eh_proj.weight"], raw["mtp.layers.1.eh_proj.weight"])
    assert state.settings["mtp_num_layers"] == 2 and state.settings["mtp_normed_hidden_states"]
    from meshtron.checkpoint.megatron.args import apply_settings

    run = apply_settings(ModelConfig(), {k: v for k, v in state.settings.items() if not k.startswith("mtp_")})
    with pytest.raises(CheckpointError) as err:
        check_model(state.settings, run, "Megatron-LM checkpoint X")
    assert err.value.differences == ["--mtp-num-layers: checkpoint 2, this run None",
                                     "--mtp-normed-hidden-states: checkpoint True, this run None"]
    run.mtp_num_layers, run.mtp_normed_hidden_states = 2, True
    check_model(state.settings, run, "Megatron-LM checkpoint X")  # the loss weight (0.3 there) is the run's choice


def test_mtp_refusals_named():
    """What meshtron's depths do not compute as megatron-core's: refused, flag by flag."""
    from meshtron.checkpoint.megatron.reader import read_common_state

    args = read_common_state(find_megatron_checkpoint(FIXTURES / "mtp_tp2pp2"))["args"]
    for change, flag in (({"mtp_use_repeated_layer": True}, "--mtp-use-repeated-layer"),
                         ({"mtp_detach_heads": True}, "--mtp-detach-heads"),
                         ({"position_embedding_type": "learned_absolute"}, "learned absolute position")):
        _assert_refused_naming(args, change, flag)


def test_detection_and_format():
    ckpt = find_megatron_checkpoint(FIXTURES / "dense_tp2pp2")
    assert (ckpt.iteration, ckpt.format) == (7, "torch_dist")
    assert find_megatron_checkpoint(FIXTURES / "legacy_tp2pp2" / "iter_0000007").format == "legacy"
    assert looks_like_megatron(FIXTURES / "moe_ep2")
    assert not looks_like_megatron(FIXTURES)


@pytest.mark.parametrize("pair", [("dense_tp2pp2", "legacy_tp2pp2"), MTP_CASES])
def test_legacy_shards_merge_to_the_torch_dist_tensors(pair):
    """The same megatron-core model saved TP=2 x PP=2 both ways: the legacy per-rank shards, merged, equal
    torch_dist's whole tensors (QKV per query group, SwiGLU [gate; up] per rank, row-parallel columns,
    layers renumbered by stage; prediction depths under ``mtp_model_layer``, their ``eh_proj`` by rows)."""
    a, b = _state(pair[0]), _state(pair[1])
    assert set(a.model) == set(b.model)
    for k in a.model:
        assert torch.equal(a.model[k], b.model[k]), k
    assert (a.iteration, a.consumed_samples, b.iteration, b.consumed_samples) == (7, 56, 7, 56)


def test_optimizer_state_maps_like_the_weights():
    """fully_reshardable's optimizer.state.<state>.<model key> go through the weights' mapping: layer 2's
    query rows of exp_avg are rows of group g's block of Megatron's interleaved QKV."""
    state = _state("dense_tp2pp2")
    assert set(state.optim) == {"master", "exp_avg", "exp_avg_sq"} and state.step == 7
    key = "optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight"
    raw = {key: torch.empty(4, 32, 16)}
    dcp.load(raw, checkpoint_id=str(FIXTURES / "dense_tp2pp2" / "iter_0000007"), no_dist=True)
    qkv = raw[key][2].reshape(2, 16, 16)  # 2 query groups x (2 query heads + k + v) x head dim 4
    torch.testing.assert_close(state.optim["exp_avg"]["layers.2.attention.q.weight"],
                               qkv[:, :8].reshape(16, 16), rtol=0, atol=0)
    torch.testing.assert_close(state.optim["exp_avg"]["layers.2.attention.v.weight"],
                               qkv[:, 12:].reshape(8, 16), rtol=0, atol=0)
    assert set(state.optim["master"]) == set(state.model)
    for k, t in state.model.items():
        torch.testing.assert_close(state.optim["master"][k], t.float(), rtol=0, atol=0)


def test_vocabulary_cut_to_the_run():
    state = _state("dense_tp2pp2", vocab_size=90)
    assert state.model["embedding.word_embeddings.weight"].shape == (90, 16)
    assert state.optim["exp_avg"]["output.weight"].shape == (90, 16)
    assert any("6 padding rows" in n for n in state.notices)


def test_flag_mismatch_named_flag_by_flag():
    state = _state("moe_ep2", optimizer=False)
    run = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, swiglu=False, normalization="LayerNorm")
    with pytest.raises(CheckpointError) as err:
        check_model(state.settings, run, "Megatron-LM checkpoint X", vocab_size=200)
    lines = err.value.differences
    for flag in ("--num-layers: checkpoint 4, this run 2", "--hidden-size: checkpoint 16, this run 32",
                 "--swiglu: checkpoint True", "--normalization: checkpoint 'RMSNorm'", "--num-experts: checkpoint 4",
                 "--num-query-groups: checkpoint 2", "vocabulary: checkpoint 96"):
        assert any(line.startswith(flag) for line in lines), (flag, lines)
    assert "Megatron-LM checkpoint X" in err.value.summary


class _Payload:
    def __reduce__(self):
        return (os.system, ("true",))


def _legacy_copy(tmp_path: Path) -> Path:
    dst = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "legacy_tp2pp2", dst)
    return dst


def test_foreign_pickle_refused_by_name(tmp_path):
    dst = _legacy_copy(tmp_path)
    f = dst / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = load_pickled(f, str(f))
    state["args"].attention_backend = "auto"  # the stand-in of Megatron's enum does not pickle back
    state["extra"] = _Payload()
    torch.save(state, f)
    with pytest.raises(CheckpointError) as err:
        read_megatron(find_megatron_checkpoint(dst))
    text = str(err.value)
    assert "\n" not in text and str(f) in text and f"{os.system.__module__}.system" in text and "Megatron" in text
    with pytest.raises(CheckpointError, match="names builtins.eval"):
        load_pickled(pickle.dumps(eval, protocol=2), "bytes")  # a plain pickle: refused before torch reads it


def test_megatron_lm_args_with_exit_signal_load(tmp_path):
    """Megatron-LM's own args hold ``exit_signal`` (``signal.SIGTERM``, an IntEnum): admitted as that member."""
    import signal
    dst = _legacy_copy(tmp_path)
    f = dst / "iter_0000007" / "mp_rank_01_001" / "model_optim_rng.pt"
    state = load_pickled(f, str(f))
    state["args"].attention_backend = "auto"  # the stand-in of Megatron's enum does not pickle back
    state["args"].exit_signal = signal.SIGTERM
    torch.save(state, f)
    assert load_pickled(f, str(f))["args"].exit_signal is signal.SIGTERM
    read_megatron(find_megatron_checkpoint(dst))


def test_rerun_state_machine_enums_become_stand_ins(monkeypatch):
    """Megatron-LM's common state holds its rerun state machine's mode and state (``str`` enums of
    ``megatron.core.rerun_state_machine``): read as stand-ins with their values, never imported."""
    import enum
    import io
    import sys
    import types

    module = types.ModuleType("megatron.core.rerun_state_machine")

    class RerunMode(str, enum.Enum):
        DISABLED = "disabled"
        VALIDATE_RESULTS = "validate_results"

    RerunMode.__module__, RerunMode.__qualname__ = module.__name__, "RerunMode"
    module.RerunMode = RerunMode
    with monkeypatch.context() as patch:  # the module and its packages exist only while the file is written
        for name in ("megatron", "megatron.core"):
            patch.setitem(sys.modules, name, types.ModuleType(name))
        patch.setitem(sys.modules, module.__name__, module)
        buf = io.BytesIO()
        torch.save({"rerun_state_machine": {"mode": RerunMode.VALIDATE_RESULTS, "current_iteration": 10}}, buf)
    state = load_pickled(buf.getvalue(), "common_state")["rerun_state_machine"]
    assert type(state["mode"]).__name__ == "RerunMode" and state["mode"].value == "validate_results"
    assert state["current_iteration"] == 10


@pytest.mark.parametrize("which", ["legacy", "distcp", "metadata"])
def test_truncated_file_refused_in_one_line(tmp_path, which):
    if which == "legacy":
        dst = _legacy_copy(tmp_path)
        f = dst / "iter_0000007" / "mp_rank_00_001" / "model_optim_rng.pt"
    else:
        dst = tmp_path / "dist"
        shutil.copytree(FIXTURES / "dense_tp2pp2", dst)
        f = dst / "iter_0000007" / ("__2_0.distcp" if which == "distcp" else ".metadata")
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError) as err:
        read_megatron(find_megatron_checkpoint(dst))
    text = str(err.value)
    assert "\n" not in text and "Megatron-LM checkpoint" in text
    assert str(f if which != "distcp" else dst / "iter_0000007") in text


def test_tracker_naming_a_missing_iteration(tmp_path):
    dst = tmp_path / "dist"
    shutil.copytree(FIXTURES / "dense_tp2pp2", dst)
    (dst / "latest_checkpointed_iteration.txt").write_text("9")
    with pytest.raises(CheckpointError, match=r"Megatron-LM checkpoint .*names iteration 9, but .*iter_0000009 is "
                                              r"missing"):
        find_megatron_checkpoint(dst)


@pytest.mark.slow
def test_train_continues_from_a_megatron_checkpoint(tmp_path):
    """meshtron train --load on Megatron's save directory: resumes at its iteration and consumed samples, with its
    optimizer state, and trains on."""
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "meshtron", "train", "--load", str(FIXTURES / "dense_tp2pp2"), "--use-checkpoint-args",
           "--mock-data", "--train-iters", "9", "--global-batch-size", "8", "--micro-batch-size", "8", "--device",
           "cpu", "--lr", "3e-4", "--log-interval", "1", "--eval-iters", "0", "--metrics-file", str(metrics)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed from" in out.stdout + out.stderr and "iteration 7" in out.stdout + out.stderr
    import json

    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in rows if r.get("type") == "train"]
    assert [r["iteration"] for r in train] == [8, 9] and train[0]["consumed_samples"] == 64


def test_mla_refusals_named():
    """Multi-latent attention without its latent norms, or with a RoPE type megatron-core does not have: refused,
    named (YaRN, megatron-core's default, is read: test_megatron_variants.py)."""
    from meshtron.checkpoint.megatron.args import model_settings
    from meshtron.checkpoint.megatron.reader import read_common_state

    args = read_common_state(find_megatron_checkpoint(FIXTURES / "mla"))["args"]
    assert model_settings(args, "X")["multi_latent_attention"]
    assert model_settings(args, "X")["rope_type"] == "rope"
    for change, flag in (({"rope_type": "mrope"}, "--rope-type mrope"), ({"qk_layernorm": False},
                                                                         "without --qk-layernorm")):
        _assert_refused_naming(args, change, flag)


def _assert_refused_naming(args, change: dict, flag: str) -> None:
    """``args`` with ``change`` applied is refused by the model-settings check, one line naming ``flag``."""
    import copy

    from meshtron.checkpoint.megatron.args import model_settings

    bad = copy.copy(args)
    for k, v in change.items():
        setattr(bad, k, v)
    with pytest.raises(CheckpointError) as err:
        model_settings(bad, "Megatron-LM checkpoint X")
    assert any(flag in line for line in err.value.differences), err.value.differences


def test_legacy_experts_with_their_own_tensor_parallelism_refused_by_name(tmp_path):
    """A legacy mixture-of-experts checkpoint with --expert-tensor-parallel-size unlike --tensor-model-parallel-size:
    its writers' names leave ranks out (one is removed here, as such a save does) and say nothing of the expert
    tensor-parallel rank, so it is refused in one line naming both flags and the format to save in instead, before
    any file is called missing."""
    dst = tmp_path / "moe"
    shutil.copytree(FIXTURES / "legacy_moe_ep2_dp4_distrib_optim", dst)
    f = dst / "iter_0000007" / "mp_rank_00_000" / "model_optim_rng.pt"
    state = load_pickled(f, str(f))
    state["args"].attention_backend = "auto"  # the stand-in of Megatron's enum does not pickle back
    state["args"].expert_tensor_parallel_size = 2
    torch.save(state, f)
    shutil.rmtree(dst / "iter_0000007" / "mp_rank_00_001")
    with pytest.raises(CheckpointError) as err:
        read_megatron(find_megatron_checkpoint(dst))
    text = str(err.value)
    assert "\n" not in text and "--expert-tensor-parallel-size 2 unlike --tensor-model-parallel-size 1" in text
    assert "--ckpt-format torch_dist" in text and "missing" not in text
