"""YaRN from plain numbers equals transformers' yarn initialisation and gpt-oss's rotary tables."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.rotary import apply_rope, rope_tables
from meshtron.layers.yarn import yarn_attention_factor, yarn_inverse_frequencies


@pytest.mark.parametrize("truncate", [False, True])
@pytest.mark.parametrize("factor,beta_fast,beta_slow", [(32.0, 32.0, 1.0), (4.0, 16.0, 2.0)])
def test_equals_transformers_yarn(truncate, factor, beta_fast, beta_slow):
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding, _apply_rotary_emb

    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": factor, "beta_fast": beta_fast,
            "beta_slow": beta_slow, "truncate": truncate, "original_max_position_embeddings": 256}
    cfg = GptOssConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_hidden_layers=1,
                       vocab_size=64, rope_parameters=rope, max_position_embeddings=256 * int(factor))
    inv_hf, scale_hf = ROPE_INIT_FUNCTIONS["yarn"](cfg, torch.device("cpu"))
    inv = yarn_inverse_frequencies(32, 150000.0, factor, 256, beta_fast, beta_slow, truncate)
    scale = yarn_attention_factor(factor)
    torch.testing.assert_close(inv, inv_hf, rtol=1e-6, atol=0)
    assert scale == pytest.approx(scale_hf, rel=1e-12)

    # the rotation of a [batch, heads, seq, dim] tensor by gpt-oss's tables and by meshtron's
    positions = torch.arange(300)
    x = torch.randn(1, 2, 300, 32)
    cos, sin = GptOssRotaryEmbedding(cfg)(x, positions[None])
    ref = _apply_rotary_emb(x, cos[:, None], sin[:, None])
    tables = rope_tables(positions, inv, torch.float32, scale)  # [seq, 1, 1, dim]
    got = apply_rope(x.permute(2, 0, 1, 3), *tables).permute(1, 2, 0, 3)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_attention_factor_variants():
    assert yarn_attention_factor(1.0) == 1.0
    assert yarn_attention_factor(32.0, attention_factor=0.5) == 0.5
    assert yarn_attention_factor(40.0, mscale=1.0, mscale_all_dim=1.0) == pytest.approx(1.0)


@pytest.mark.parametrize("factor,mscale,mscale_all_dim,dim", [(4.0, 1.0, 0.7, 8), (40.0, 1.0, 1.0, 64),
                                                              (1.0, 1.0, 0.0, 64), (8.0, 0.9, 0.0, 16)])
def test_mla_yarn_equals_megatron_cores(factor, mscale, mscale_all_dim, dim):
    """Multi-latent attention's YaRN as megatron-core 0.19 computes it (``YarnRotaryEmbedding.get_emb``, its
    concentration factor on cos/sin, MLA's softmax scale mscale(factor, mscale_all_dim)^2 / sqrt(head dim)):
    meshtron's frequencies, table scale and softmax scale, at megatron-core's MLA defaults (original context
    4096, betas 32/1, ramp ends rounded)."""
    import math

    from tests.megatron_oracle import _core_package

    _core_package()  # skips without megatron-core
    try:
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
    except ImportError as err:  # its imports need more than this machine has
        pytest.skip(f"megatron-core's YaRN module does not import here: {err}")
    from meshtron.config import ModelConfig
    from meshtron.layers.mla import mla_softmax_scale
    from meshtron.layers.rotary import inverse_frequencies, rope_table_scale

    base = 10000.0
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inter = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    low, high = yarn._yarn_find_correction_range(32.0, 1.0, dim, base, 4096, True)
    mask = 1.0 - yarn._yarn_linear_ramp_mask(low, high, dim // 2, torch.device("cpu"))
    theirs = inter * (1 - mask) + extra * mask
    m = ModelConfig(multi_latent_attention=True, rope_type="yarn", qk_pos_emb_head_dim=dim, qk_head_dim=16,
                    rotary_scaling_factor=factor, mscale=mscale, mscale_all_dim=mscale_all_dim)
    torch.testing.assert_close(inverse_frequencies(dim, base, torch.device("cpu"), m), theirs, rtol=1e-6, atol=0)
    assert rope_table_scale(m) == pytest.approx(yarn._yarn_get_concentration_factor(factor, mscale, mscale_all_dim),
                                                rel=1e-12)
    softmax = yarn._yarn_get_mscale(factor, mscale_all_dim) ** 2 / math.sqrt(16 + dim)
    assert mla_softmax_scale(m) == pytest.approx(softmax, rel=1e-12)


def _megatron_yarn_module(monkeypatch):
    """megatron-core's yarn_rotary_pos_embedding, its CUDA device calls pointed at the CPU, or skip."""
    from tests.megatron_oracle import _core_package

    _core_package()  # skips without megatron-core
    try:
        from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
    except ImportError as err:  # its imports need more than this machine has
        pytest.skip(f"megatron-core's YaRN module does not import here: {err}")
    # YarnRotaryEmbedding moves its frequencies to torch.cuda.current_device() on first use
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    return yarn


@pytest.mark.parametrize("flags", [
    [],  # megatron-training's defaults: factor 1 (plain RoPE), context 4096, betas 32/1, rounded ramp
    ["--rotary-scaling-factor", "4", "--yarn-original-max-position-embeddings", "64"],
    ["--rotary-scaling-factor", "8", "--yarn-original-max-position-embeddings", "128", "--yarn-beta-fast", "16",
     "--yarn-beta-slow", "2", "--no-yarn-correction-range-round-to-int"],
    ["--rotary-scaling-factor", "32", "--yarn-original-max-position-embeddings", "256", "--mscale", "0.8",
     "--mscale-all-dim", "0.3", "--yarn-correction-range-round-to-int", "--rotary-base", "500000"],
])
def test_gqa_yarn_equals_megatron_cores(flags, monkeypatch):
    """--position-embedding-type yarn of a grouped-query attention model, with Megatron-LM's flags: meshtron's
    cos/sin tables (frequencies times the concentration factor) equal megatron-core's YarnRotaryEmbedding built
    as megatron-training builds it (its unset flags at their defaults), and its rotation of a query."""
    from meshtron.cli import build_config
    from meshtron.layers.rotary import inverse_frequencies, rope_table_scale
    from meshtron.validation import validate_config

    yarn = _megatron_yarn_module(monkeypatch)
    cfg = build_config(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
                        "--group-query-attention", "--num-query-groups", "2", "--position-embedding-type", "yarn",
                        *flags])
    validate_config(cfg, 1)
    m = cfg.model
    assert (m.position_embedding_type, m.rope_type) == ("rope", "yarn")
    ref = yarn.YarnRotaryEmbedding(
        kv_channels=32, rotary_base=m.rotary_base, use_cpu_initialization=True, scaling_factor=m.rotary_scaling_factor,
        original_max_position_embeddings=m.yarn_original_max_position_embeddings, beta_fast=m.yarn_beta_fast,
        beta_slow=m.yarn_beta_slow, mscale=m.mscale, mscale_all_dim=m.mscale_all_dim,
        correction_range_round_to_int=m.yarn_truncate)
    emb, concentration = ref(600)
    inv = inverse_frequencies(32, m.rotary_base, torch.device("cpu"), m)
    cos, sin = rope_tables(torch.arange(600), inv, torch.float32, rope_table_scale(m))
    assert rope_table_scale(m) == pytest.approx(concentration, rel=1e-12)
    # the same fp32 operations in the same order: the same numbers
    assert torch.equal(cos, emb.cos() * concentration) and torch.equal(sin, emb.sin() * concentration)

    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    x = torch.randn(600, 2, 4, 32)
    theirs = _apply_rotary_pos_emb_bshd(x, emb, rotary_interleaved=False, mscale=concentration)
    torch.testing.assert_close(apply_rope(x, cos, sin), theirs, rtol=1e-6, atol=1e-6)


def test_gqa_yarn_flag_spellings_agree():
    """--position-embedding-type yarn is --position-embedding-type rope --rope-type yarn, and
    --no-yarn-correction-range-round-to-int is --no-yarn-truncate."""
    from meshtron.cli import build_config
    from meshtron.validation import validate_config

    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--rotary-scaling-factor", "4"]
    a = build_config(base + ["--position-embedding-type", "yarn", "--no-yarn-correction-range-round-to-int"])
    b = build_config(base + ["--position-embedding-type", "rope", "--rope-type", "yarn", "--no-yarn-truncate"])
    validate_config(a, 1)
    validate_config(b, 1)
    assert a.model == b.model
