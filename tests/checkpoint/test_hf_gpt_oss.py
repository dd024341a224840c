"""Hugging Face gpt-oss <-> meshtron: a tiny random GptOssForCausalLM (sliding-window and full layers, sinks,
biases, clamped SwiGLU experts, YaRN with a fractional ramp) converted with ``convert --from hf`` gives
transformers' logits in fp32, and exported back loads in transformers with the same tensors and logits."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_checkpoint_convert import VOCAB, logits, write_tokenizer  # noqa: E402
from meshtron.checkpoint import hf, load_for_inference  # noqa: E402
from meshtron.checkpoint.convert import convert_main  # noqa: E402
from meshtron.checkpoint.errors import CheckpointError  # noqa: E402
from meshtron.config import MeshtronConfig  # noqa: E402
from meshtron.presets import apply_preset  # noqa: E402
from tests.test_generate_new_mixers import incremental_logits  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def gpt_oss_config(**kw):
    values = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
                  max_position_embeddings=64, rope_parameters=YARN, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2)
    values.update(kw)
    return transformers.GptOssConfig(**values)


def random_gpt_oss(config, seed: int = 0):
    """Norms away from 1, larger weights (decisive routing, clamps that act): every tensor matters."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 1 or name.endswith("_bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_((0.5 if "router" in name else 0.25) * torch.randn_like(p))
    return model


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


def test_gpt_oss_round_trip(tmp_path):
    reference = random_gpt_oss(gpt_oss_config())
    hf_in, ckpt, hf_out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_out"
    reference.save_pretrained(hf_in)
    write_tokenizer(hf_in)
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt)]) == 0
    model, _ = load_for_inference(ckpt, "cpu")
    assert model.cfg.layer_pattern == "sink_window+oss_moe,sink+oss_moe,sink_window+oss_moe,sink+oss_moe"
    want = logits(reference, TOKENS)
    assert want.abs().max() > 1  # not a degenerate comparison
    torch.testing.assert_close(logits(model, TOKENS), want, rtol=1e-5, atol=1e-5)
    # generation: a prompt, then one token at a time, gives Hugging Face's logits of the whole sequence
    torch.testing.assert_close(incremental_logits(model, TOKENS, 9), want, rtol=1e-5, atol=1e-5)

    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(hf_out)]) == 0
    config = json.loads((hf_out / "config.json").read_text())
    assert config["architectures"] == ["GptOssForCausalLM"]
    again = transformers.GptOssForCausalLM.from_pretrained(hf_out, attn_implementation="eager").eval()
    ref_state, state = reference.state_dict(), again.state_dict()
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        assert torch.equal(ref_state[name], state[name]), name
    for key in ("layer_types", "sliding_window", "rope_parameters", "swiglu_limit", "num_experts_per_tok", "head_dim"):
        assert again.config.to_dict()[key] == reference.config.to_dict()[key], key
    torch.testing.assert_close(logits(again, TOKENS), want, rtol=0, atol=0)


def test_gpt_oss_export_refuses_other_layers():
    cfg = MeshtronConfig()
    apply_preset(cfg.model, "gpt-oss-20b")
    cfg.model.num_layers, cfg.model.layer_pattern = 2, "sink_window+oss_moe,gqa+moe"
    with pytest.raises(CheckpointError) as err:
        hf.check_exportable(cfg.model, "gpt_oss")
    assert "gqa+moe" in str(err.value.differences)
    cfg.model.layer_pattern = "sink_window+oss_moe,sink+oss_moe"
    assert hf.default_architecture(cfg.model) == "gpt_oss"
    with pytest.raises(CheckpointError):
        hf.check_exportable(cfg.model, "mixtral")
