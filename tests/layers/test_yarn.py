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
