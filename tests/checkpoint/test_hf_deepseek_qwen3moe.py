"""Hugging Face DeepSeek-V2/V3 and Qwen3-MoE <-> meshtron: transformers' logits, identical tensors after a round
trip, the default export architecture, DeepSeek-V3's multi-token prediction layers (imported, exported back, or
skipped), and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_checkpoint_convert import VOCAB, logits, write_tokenizer  # noqa: E402
from meshtron.checkpoint import load_for_inference  # noqa: E402
from meshtron.checkpoint import hf  # noqa: E402
from meshtron.checkpoint.convert import convert_main  # noqa: E402
from meshtron.checkpoint.errors import CheckpointError  # noqa: E402
from meshtron.checkpoint.metadata import compare_signatures, model_signature, read_config  # noqa: E402

COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MLA = dict(num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}


def deepseek_v3_config(**kw):
    """Sigmoid routing with expert bias, 4 groups of 4 experts (2 chosen, 4 // 2 = 2 per group as HF scores them),
    scaling 2.5, 2 shared experts, layer 0 dense, YaRN, interleaved rotary rows."""
    values = dict(COMMON, **MLA, first_k_dense_replace=1, n_routed_experts=16, moe_intermediate_size=12,
                  n_shared_experts=2, num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                  norm_topk_prob=True, rope_parameters=YARN, rope_interleave=True)
    values.update(kw)
    return transformers.DeepseekV3Config(**values)


def deepseek_v2_config():
    """DeepSeek-V2-Lite's kind: no query latent, softmax top-k kept unnormalised, group-limited (best value per
    group, 4 // 3 = 1), scaling 1.5, default RoPE."""
    return transformers.DeepseekV2Config(
        **COMMON, **dict(MLA, q_lora_rank=None), first_k_dense_replace=1, n_routed_experts=16,
        moe_intermediate_size=12, n_shared_experts=2, num_experts_per_tok=4, topk_method="group_limited_greedy",
        n_group=4, topk_group=3, routed_scaling_factor=1.5, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def qwen3_moe_config(**kw):
    values = dict(COMMON, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, use_sliding_window=False)
    values.update(kw)
    return transformers.Qwen3MoeConfig(**values)


FAMILIES = {
    "deepseek_v3": (transformers.DeepseekV3ForCausalLM, deepseek_v3_config),
    "deepseek_v2": (transformers.DeepseekV2ForCausalLM, deepseek_v2_config),
    "qwen3_moe": (transformers.Qwen3MoeForCausalLM, qwen3_moe_config),
}


def test_qwen3_moe_without_norm_topk_prob_keeps_the_softmax_weights():
    """norm_topk_prob false is --moe-router-pre-softmax (the path DeepSeek-V2's round trip checks against
    transformers); true is the default router."""
    assert hf.config_from_hf(qwen3_moe_config(norm_topk_prob=False).to_dict(), []).model.moe_router_pre_softmax
    assert not hf.config_from_hf(qwen3_moe_config().to_dict(), []).model.moe_router_pre_softmax


def random_model(cls, config, seed: int = 0):
    """Norms away from 1, larger weights (decisive routing, logits well above 1e-5) and a random expert bias: every tensor matters."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_((0.5 if name.endswith("mlp.gate.weight") else 0.2) * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


TOKENS = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_moe_round_trip(tmp_path, family):
    cls, make_config = FAMILIES[family]
    reference = random_model(cls, make_config())
    hf_in, ckpt, hf_out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_out"
    reference.save_pretrained(hf_in, max_shard_size="200KB")  # per-expert names, sharded
    write_tokenizer(hf_in)
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt)]) == 0
    model, _ = load_for_inference(ckpt, "cpu")
    want = logits(reference, TOKENS)
    assert want.abs().max() > 1  # not a degenerate comparison
    torch.testing.assert_close(logits(model, TOKENS), want, rtol=1e-5, atol=1e-5)

    # the default architecture is the family's own
    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(hf_out)]) == 0
    config = json.loads((hf_out / "config.json").read_text())
    assert config["architectures"] == [cls.__name__]
    again = cls.from_pretrained(hf_out, attn_implementation="eager").eval()
    ref_state, state = reference.state_dict(), again.state_dict()
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        assert torch.equal(ref_state[name], state[name]), name
    for key, value in reference.config.to_dict().items():
        if key in ("n_group", "topk_group", "routed_scaling_factor", "first_k_dense_replace", "n_shared_experts",
                   "num_experts_per_tok", "norm_topk_prob", "topk_method", "mlp_only_layers", "rope_parameters",
                   "q_lora_rank", "kv_lora_rank", "head_dim", "rope_interleave"):
            assert again.config.to_dict()[key] == value, key
    torch.testing.assert_close(logits(again, TOKENS), want, rtol=0, atol=0)


def test_fused_in_memory_layout_and_mtp_layers_skipped(tmp_path, capsys):
    """transformers 5's fused expert tensors (the in-memory state dict) read as well; DeepSeek-V3's
    multi-token prediction layer (model.layers.3 of 3 layers) is skipped with a notice under --skip-mtp, and
    an incomplete one is refused without it."""
    from safetensors.torch import save_file

    reference = random_model(transformers.DeepseekV3ForCausalLM, deepseek_v3_config())
    state = {k: v.contiguous() for k, v in reference.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    state["model.layers.3.eh_proj.weight"] = torch.randn(64, 128)
    state["model.layers.3.self_attn.q_a_proj.weight"] = torch.randn(24, 64)
    hf_in, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    hf_in.mkdir()
    save_file(state, str(hf_in / "model.safetensors"))
    reference.config.save_pretrained(hf_in)
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(tmp_path / "refused")]) == 2
    assert "mtp.layers.*.enorm.weight (64,) is missing" in capsys.readouterr().err  # the prediction layer
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt), "--skip-mtp"]) == 0
    assert "skipped the multi-token prediction layer(s) [3]" in capsys.readouterr().err
    assert read_config(ckpt / "iter_0000000").model.mtp_num_layers is None
    model, _ = load_for_inference(ckpt, "cpu")
    torch.testing.assert_close(logits(model, TOKENS), logits(reference, TOKENS), rtol=1e-5, atol=1e-5)


def _rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight


def _deepseek_v3_with_mtp(tmp_path):
    """A DeepSeek-V3 directory of 3 layers whose weights also hold its multi-token prediction layer
    (model.layers.3): the decoder layer is layer 3 of another, 4-layer transformers model; enorm, hnorm,
    eh_proj and shared_head.norm are random; embed_tokens and shared_head.head copy the model's.
    Returns (the 3-layer model, the 4-layer one, the directory's tensors, the directory)."""
    from safetensors.torch import save_file

    from meshtron.checkpoint.convert import read_hf_tensors

    cls = transformers.DeepseekV3ForCausalLM
    reference = random_model(cls, deepseek_v3_config(num_nextn_predict_layers=1))
    donor = random_model(cls, deepseek_v3_config(num_hidden_layers=4), seed=1)
    reference.save_pretrained(tmp_path / "main")
    donor.save_pretrained(tmp_path / "donor")
    state = read_hf_tensors(tmp_path / "main")
    state.update({k: v for k, v in read_hf_tensors(tmp_path / "donor").items() if hf.hf_layer_index(k) == 3})
    g = torch.Generator().manual_seed(2)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        state[f"model.layers.3.{norm}.weight"] = 1 + 0.3 * torch.randn(64, generator=g)
    state["model.layers.3.eh_proj.weight"] = 0.2 * torch.randn(64, 128, generator=g)
    state["model.layers.3.embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    state["model.layers.3.shared_head.head.weight"] = state["lm_head.weight"].clone()
    hf_in = tmp_path / "hf"
    hf_in.mkdir()
    save_file(state, str(hf_in / "model.safetensors"))
    reference.config.save_pretrained(hf_in)
    write_tokenizer(hf_in)
    return reference, donor, state, hf_in


def _reference_depth_loss(reference, donor, state: dict, tokens, mtp_tokens, mtp_labels, mtp_mask) -> torch.Tensor:
    """DeepSeek-V3's first prediction depth from transformers' pieces: h^0 (the input of the final norm),
    eh_proj([enorm(embed(t_{i+1})); hnorm(h^0)]), the decoder layer, shared_head, and the mean cross-entropy
    over the valid positions."""
    seen: dict = {}
    hooks = [reference.model.layers[0].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True),
             reference.model.norm.register_forward_hook(lambda m, a, out: seen.update(h0=a[0]))]
    with torch.no_grad():
        reference(tokens)
        for h in hooks:
            h.remove()
        w = {k[len("model.layers.3."):]: v for k, v in state.items() if k.startswith("model.layers.3.")}
        e = torch.nn.functional.embedding(mtp_tokens, w["embed_tokens.weight"])
        x = torch.cat([_rms(e, w["enorm.weight"]), _rms(seen["h0"], w["hnorm.weight"])], -1) @ w["eh_proj.weight"].t()
        kwargs = {k: seen[k] for k in ("position_embeddings", "attention_mask", "position_ids")}
        out = donor.model.layers[3](x, **kwargs)
        h1 = out[0] if isinstance(out, tuple) else out
        depth_logits = _rms(h1, w["shared_head.norm.weight"]) @ w["shared_head.head.weight"].t()
        ce = torch.nn.functional.cross_entropy(depth_logits.reshape(-1, VOCAB), mtp_labels.reshape(-1),
                                               reduction="none")
        return (ce * mtp_mask.reshape(-1)).sum() / mtp_mask.sum()


def test_deepseek_v3_mtp_layer_round_trip(tmp_path, capsys):
    """DeepSeek-V3's multi-token prediction layer imports as --mtp-num-layers 1 (the depth computes what
    DeepSeek's module computes from transformers' pieces; the main logits stay transformers') and exports back
    to identical tensors, with num_nextn_predict_layers; a copy of the embedding that differs is refused."""
    from meshtron.checkpoint.convert import read_hf_tensors
    from meshtron.layers.mtp import add_mtp_inputs, mtp_blocks

    reference, donor, state, hf_in = _deepseek_v3_with_mtp(tmp_path)
    ckpt, hf_out = tmp_path / "ckpt", tmp_path / "hf_out"
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt)]) == 0
    assert "multi-token" not in capsys.readouterr().err  # imported, not skipped
    assert read_config(ckpt / "iter_0000000").model.mtp_num_layers == 1
    model, _ = load_for_inference(ckpt, "cpu")
    want = logits(reference, TOKENS)
    torch.testing.assert_close(logits(model, TOKENS), want, rtol=1e-5, atol=1e-5)

    labels = torch.cat([TOKENS[:, 1:], torch.zeros_like(TOKENS[:, :1])], 1)
    mask = torch.ones(TOKENS.shape)
    mask[:, -1] = 0
    mb = add_mtp_inputs({"tokens": TOKENS, "labels": labels, "loss_mask": mask}, 1)
    mtp_mask = mb["mtp_loss_mask"]
    model.train()
    with torch.no_grad():
        model(tokens=TOKENS, labels=labels, loss_weight=mask / mask.sum(), mtp_tokens=mb["mtp_tokens"],
              mtp_labels=mb["mtp_labels"], mtp_loss_weight=mtp_mask / mtp_mask.sum(dim=(0, 1)))
    depth_loss = mtp_blocks([model])[0].loss_sums[0]
    want_loss = _reference_depth_loss(reference, donor, state, TOKENS, mb["mtp_tokens"][..., 0],
                                      mb["mtp_labels"][..., 0], mtp_mask[..., 0])
    assert want_loss > 1  # random weights: far from a degenerate comparison
    torch.testing.assert_close(depth_loss, want_loss, rtol=1e-5, atol=1e-5)

    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(hf_out)]) == 0
    assert json.loads((hf_out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    exported = read_hf_tensors(hf_out)
    assert exported.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(exported[name], t), name
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(hf_out, attn_implementation="eager").eval()
    torch.testing.assert_close(logits(again, TOKENS), want, rtol=0, atol=0)

    # --skip-mtp on export: the main model alone, num_nextn_predict_layers 0
    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(tmp_path / "main_only"),
                         "--skip-mtp"]) == 0
    assert json.loads((tmp_path / "main_only" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert all(hf.hf_layer_index(k) in (None, 0, 1, 2) for k in read_hf_tensors(tmp_path / "main_only"))

    # the prediction layer's copy of the embedding must be the embedding
    from safetensors.torch import save_file

    state["model.layers.3.embed_tokens.weight"] = state["model.layers.3.embed_tokens.weight"] + 1e-3
    save_file(state, str(hf_in / "model.safetensors"))
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(tmp_path / "bad")]) == 2
    assert "model.layers.3.embed_tokens.weight differs" in capsys.readouterr().err


def test_mtp_export_to_another_architecture_is_refused():
    import dataclasses

    m = dataclasses.replace(hf.config_from_hf(qwen3_moe_config().to_dict(), []).model, mtp_num_layers=1)
    with pytest.raises(CheckpointError) as err:
        hf.check_exportable(m, "qwen3_moe")
    assert "--mtp-num-layers 1" in " ".join(err.value.differences)


def test_rotary_rows_without_interleave(tmp_path):
    """rope_interleave false (rotate-half rows) converts without the row permutation."""
    reference = random_model(transformers.DeepseekV3ForCausalLM,
                             deepseek_v3_config(rope_interleave=False, n_group=1, topk_group=1))
    reference.save_pretrained(tmp_path / "hf")
    assert convert_main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    model, _ = load_for_inference(tmp_path / "ckpt", "cpu")
    torch.testing.assert_close(logits(model, TOKENS), logits(reference, TOKENS), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,changes,message", [
    ("deepseek_v3", dict(num_experts_per_tok=6, topk_group=2), "scores each group by its best 2"),
    ("deepseek_v3", dict(norm_topk_prob=False), "without norm_topk_prob"),
    ("deepseek_v3", dict(rms_norm_eps=1e-5), "latent norms use 1e-6"),
    ("deepseek_v2", dict(norm_topk_prob=True), "ignores it"),
    ("deepseek_v2", dict(num_experts_per_tok=6, topk_group=3), "best 1 value"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step 2"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "only the first layers can be dense"),
])
def test_routing_without_a_meshtron_equivalent_is_refused(kind, changes, message):
    configs = {"deepseek_v3": deepseek_v3_config, "deepseek_v2": deepseek_v2_config, "qwen3_moe": qwen3_moe_config}
    values = configs[kind]().to_dict()
    values.update(changes)
    with pytest.raises(CheckpointError, match=message):
        hf.config_from_hf(values, [])


def _mla_model():
    return hf.config_from_hf(deepseek_v3_config().to_dict(), []).model


def test_mla_export_as_llama_is_refused():
    with pytest.raises(CheckpointError) as err:
        hf.check_exportable(_mla_model(), "llama")
    assert "--multi-latent-attention" in " ".join(err.value.differences)
    with pytest.raises(CheckpointError) as err:
        hf.check_exportable(hf.config_from_hf(qwen3_moe_config().to_dict(), []).model, "deepseek_v3")
    assert "no --multi-latent-attention" in " ".join(err.value.differences)
    assert hf.default_architecture(_mla_model()) == "deepseek_v3"


def test_signature_tells_mla_and_routing_apart():
    m = _mla_model()
    base = model_signature(m, VOCAB)
    for field, value in [("kv_lora_rank", 32), ("qk_pos_emb_head_dim", 8), ("moe_router_score_function", "softmax"),
                         ("moe_router_enable_expert_bias", False), ("moe_router_group_topk", 1),
                         ("moe_first_dense_layers", 2), ("moe_router_topk_scaling_factor", None)]:
        other = read_config_like(m, **{field: value})
        diffs = compare_signatures(base, model_signature(other, VOCAB))
        assert len(diffs) == 1 and diffs[0].startswith(field), (field, diffs)
    # a default-routing signature (as older checkpoints wrote it) still matches
    plain = hf.config_from_hf(qwen3_moe_config().to_dict(), []).model
    saved = model_signature(plain, VOCAB)
    assert "moe_router_score_function" not in saved and not compare_signatures(saved, model_signature(plain, VOCAB))


def read_config_like(m, **changes):
    import dataclasses

    return dataclasses.replace(m, **changes)


def test_converted_config_round_trips_through_the_checkpoint(tmp_path):
    reference = random_model(transformers.DeepseekV2ForCausalLM, deepseek_v2_config())
    reference.save_pretrained(tmp_path / "hf")
    assert convert_main(["--from", "hf", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "ckpt")]) == 0
    m = read_config(tmp_path / "ckpt" / "iter_0000000").model
    assert (m.multi_latent_attention, m.q_lora_rank, m.moe_router_pre_softmax, m.moe_router_num_groups,
            m.moe_router_topk_scaling_factor, m.moe_shared_expert_intermediate_size) == (True, None, True, 4, 1.5, 24)
    assert hf.default_architecture(m) == "deepseek_v2"
