"""Hugging Face Qwen3.5 and Qwen3.5-MoE <-> meshtron: tiny random Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM
(gated DeltaNet and gated attention layers as ``layer_types`` says, zero-centred norms, partial RoPE, the MoE's
sigmoid-gated shared expert) converted with ``convert --from hf`` give transformers' logits in fp32, and exported
back load in transformers with the same tensors and logits."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_checkpoint_convert import VOCAB, logits, write_tokenizer  # noqa: E402
from meshtron.checkpoint import hf, load_for_inference  # noqa: E402
from meshtron.checkpoint.convert import convert_main  # noqa: E402
from meshtron.checkpoint.errors import CheckpointError  # noqa: E402
from tests.layers.canonical import close  # noqa: E402
from tests.test_generate_new_mixers import incremental_logits  # noqa: E402

COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_conv_kernel_dim=4, max_position_embeddings=128,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def dense_config():
    return transformers.Qwen3_5TextConfig(**COMMON, intermediate_size=48)


def moe_config():
    return transformers.Qwen3_5MoeTextConfig(**COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                                             shared_expert_intermediate_size=16)


FAMILIES = {"qwen3_5": (transformers.Qwen3_5ForCausalLM, dense_config, "gdn+dense,gated_attn+dense"),
            "qwen3_5_moe": (transformers.Qwen3_5MoeForCausalLM, moe_config,
                            "gdn+moe_gated_shared,gated_attn+moe_gated_shared")}


def random_model(cls, config, seed: int = 0):
    """Norm weights away from 0 (their scale is 1 + w), larger weights (decisive routing): every tensor matters."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_((0.5 if name.endswith("mlp.gate.weight") else 0.2) * torch.randn_like(p))
    return model


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
LONG = torch.randint(0, VOCAB, (2, 80), generator=torch.Generator().manual_seed(2))  # two 64-token chunks


@pytest.mark.parametrize("family", FAMILIES)
def test_qwen3_5_round_trip(tmp_path, family):
    cls, make_config, pattern = FAMILIES[family]
    reference = random_model(cls, make_config())
    hf_in, ckpt, hf_out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_out"
    reference.save_pretrained(hf_in)
    write_tokenizer(hf_in)
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt)]) == 0
    model, _ = load_for_inference(ckpt, "cpu")
    assert model.cfg.layer_pattern == f"{pattern},{pattern}"
    want = logits(reference, TOKENS)
    assert want.abs().max() > 1  # not a degenerate comparison
    torch.testing.assert_close(logits(model, TOKENS), want, rtol=1e-5, atol=1e-5)
    # Over longer sequences transformers' fp32 drifts from its own float64 run by a few 1e-5 (the chunked rule's
    # sums): the comparison there is with the float64 run, to 1e-5 of the largest logit (the dense model: the
    # MoE's experts do not run in float64 in transformers; its gdn layers are the same).
    if family == "qwen3_5":
        close(logits(model, LONG), logits(copy.deepcopy(reference).double(), LONG).float(), "80 tokens")
    # generation: a prompt, then one token at a time, gives Hugging Face's logits of the whole sequence (to
    # 1e-4: a step's recurrence and the prefill's chunks round differently by ~1e-6 in the first layer, which
    # this random model's layers grow to a few 1e-5 in its most sensitive logits)
    torch.testing.assert_close(incremental_logits(model, TOKENS, 9), want, rtol=1e-5, atol=1e-4)

    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(hf_out)]) == 0
    config = json.loads((hf_out / "config.json").read_text())
    assert config["architectures"] == [cls.__name__]
    again = cls.from_pretrained(hf_out, attn_implementation="eager").eval()
    ref_state, state = reference.state_dict(), again.state_dict()
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        assert torch.equal(ref_state[name], state[name]), name
    for key in ("layer_types", "rope_parameters", "linear_num_value_heads", "head_dim"):
        assert again.config.to_dict()[key] == reference.config.to_dict()[key], key
    torch.testing.assert_close(logits(again, TOKENS), want, rtol=0, atol=0)


def test_qwen3_5_export_refuses_other_layers_and_architectures():
    cfg = hf.config_from_hf(dense_config().to_dict(), [])
    assert hf.default_architecture(cfg.model) == "qwen3_5_text"
    with pytest.raises(CheckpointError):
        hf.check_exportable(cfg.model, "llama")
    cfg.model.layer_pattern = "gdn+dense,gqa+dense,gdn+dense,gated_attn+dense"
    with pytest.raises(CheckpointError) as err:
        hf.check_exportable(cfg.model, "qwen3_5_text")
    assert "gqa+dense" in str(err.value.differences)
