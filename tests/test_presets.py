"""Model presets: published shapes and parameter counts, and how they combine with flags."""

from __future__ import annotations

import pytest

from meshtron import validation
from meshtron.cli import build_config
from meshtron.config import ModelConfig
from meshtron.presets import PRESETS, PUBLISHED_ACTIVE, apply_preset, count_parameters

#: the presets the foundation promises (more may exist)
REQUIRED = {"tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "llama2-7b", "llama2-13b", "llama2-70b",
            "llama3-1b", "llama3-3b", "llama3-8b", "llama3-70b", "llama3-405b", "mistral-7b"}

PUBLISHED = [name for name, (_, published, _) in PRESETS.items() if published]


def preset(name: str) -> ModelConfig:
    m = ModelConfig()
    apply_preset(m, name)
    return m


def test_required_presets_exist() -> None:
    assert REQUIRED <= set(PRESETS)


@pytest.mark.parametrize("name", PUBLISHED)
def test_parameter_count_matches_published(name: str) -> None:
    published = PRESETS[name][1]
    total = count_parameters(preset(name))["total"]
    assert abs(total - published) / published < 0.01, f"{name}: {total:,} vs published {published:,}"


def test_known_counts_by_hand() -> None:
    # GPT-2 small: 12 layers x (4*768^2 + 4*768 attention, 8*768^2 + 5*768 MLP, 4*768 norms)
    # + 50257*768 tokens + 1024*768 positions + 2*768 final norm.
    H = 768
    per_layer = (4 * H * H + 4 * H) + (8 * H * H + 5 * H) + 4 * H
    assert count_parameters(preset("gpt2-small"))["total"] == 12 * per_layer + 50257 * H + 1024 * H + 2 * H


def test_moe_counts_active_experts_only_for_flops() -> None:
    counts = count_parameters(preset("mixtral-8x7b"))
    assert counts["matmul"] < counts["total"] / 3  # 2 of 8 experts per token


@pytest.mark.parametrize("name,world,flags", [
    ("tiny", 1, []),
    ("gpt2-small", 1, []),
    ("llama3-8b", 8, ["--tensor-model-parallel-size", "8", "--sequence-parallel"]),
    ("llama3-70b", 64, ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4"]),
    ("llama3-405b", 128, ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
                          "--decoder-first-pipeline-num-layers", "15", "--decoder-last-pipeline-num-layers", "15",
                          "--context-parallel-size", "2"]),
    ("mixtral-8x7b", 32, ["--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "8"]),
])
def test_presets_validate_in_typical_layouts(name: str, world: int, flags: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)
    cfg = build_config(["--model", name, "--mock-data", *flags])
    validation.validate_config(cfg, world)
    assert cfg.model.model == name


def test_flags_override_preset_fields() -> None:
    cfg = build_config(["--model", "llama3-8b", "--num-layers", "2", "--seq-length", "512", "--no-swiglu"])
    assert (cfg.model.num_layers, cfg.model.seq_length, cfg.model.swiglu) == (2, 512, False)
    assert cfg.model.hidden_size == 4096 and cfg.model.num_query_groups == 8


#: count_parameters(...)["active"] of the MoE presets, exactly (HF config shapes; tests/test_parameter_count.py
#: checks the totals against transformers' models)
ACTIVE = {"deepseek-moe-16b": 2_828_650_496, "deepseek-v2-lite": 2_661_150_208, "deepseek-v3": 37_552_282_624,
          "qwen3-30b-a3b": 3_353_032_704, "qwen3-235b-a22b": 22_190_763_520, "gpt-oss-20b": 4_187_440_704,
          "gpt-oss-120b": 5_711_982_912, "qwen3.5-35b-a3b": 3_454_988_928}


@pytest.mark.parametrize("name", sorted(PUBLISHED_ACTIVE))
def test_active_parameters_match_published(name: str) -> None:
    counts = count_parameters(preset(name))
    assert counts["active"] == ACTIVE[name]
    published, with_embedding = PUBLISHED_ACTIVE[name]
    ours = counts["active"] - (0 if with_embedding else counts["embedding"])
    assert abs(ours - published) / published < 0.025, f"{name}: {ours:,} vs published {published:,}"


def test_active_is_total_less_the_unrouted_experts() -> None:
    m = preset("qwen3-30b-a3b")
    counts = count_parameters(m)
    expert = 3 * m.hidden_size * m.moe_ffn_hidden_size
    assert counts["total"] - counts["active"] == m.num_layers * (m.num_experts - m.moe_router_topk) * expert
    dense = count_parameters(preset("llama3-8b"))
    assert dense["active"] == dense["total"]


def test_presets_command_shows_active_parameters(capsys: pytest.CaptureFixture) -> None:
    from meshtron.cli import presets_main, preset_rows

    rows = {r["name"]: r for r in preset_rows()}
    assert rows["deepseek-v3"]["active_params"] == ACTIVE["deepseek-v3"]
    assert rows["deepseek-v3"]["published_active_params"] == 37_000_000_000
    assert rows["llama3-8b"]["active_params"] is None
    assert presets_main([]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("qwen3-235b-a22b"))
    assert "22.2B" in line and "22B" in line


@pytest.mark.parametrize("name,world,flags", [
    ("deepseek-v3", 256, ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
                          "--decoder-first-pipeline-num-layers", "16", "--decoder-last-pipeline-num-layers", "15",
                          "--expert-model-parallel-size", "8", "--sequence-parallel"]),
    ("deepseek-v2-lite", 8, ["--expert-model-parallel-size", "8"]),
    ("qwen3-30b-a3b", 8, ["--expert-model-parallel-size", "8"]),
    ("qwen3-235b-a22b", 64, ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "2",
                             "--expert-model-parallel-size", "8"]),
])
def test_fine_grained_moe_presets_validate(name: str, world: int, flags: list[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "_cuda_available", lambda: True)
    cfg = build_config(["--model", name, "--mock-data", *flags])
    validation.validate_config(cfg, world)
