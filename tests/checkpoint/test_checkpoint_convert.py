"""Hugging Face <-> meshtron conversion: the same logits as transformers, identical tensors after a round trip."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckpt_helpers import build_chunks, tiny_config  # noqa: E402
from meshtron.checkpoint import load_checkpoint, load_for_inference, save_checkpoint  # noqa: E402
from meshtron.checkpoint.convert import convert_main  # noqa: E402
from meshtron.parallel.context import ParallelContext  # noqa: E402
from meshtron.training.state import TrainingState  # noqa: E402
from meshtron.validation import validate_config  # noqa: E402

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def llama3():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))


def llama_yarn():
    """YaRN at transformers' defaults for what is not given (the ramp's ends rounded, temperature 0.1 ln 4 + 1)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 16.0,
                         "beta_slow": 2.0, "original_max_position_embeddings": 16}))


def qwen3_yarn():
    """YaRN with fractional ramp ends and both mscales (the tables scaled by their quotient)."""
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, use_sliding_window=False,
        sliding_window=None, max_window_layers=2,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "truncate": False, "mscale": 0.9,
                         "mscale_all_dim": 0.3, "original_max_position_embeddings": 16}))


def mistral_tied():
    return transformers.MistralForCausalLM(transformers.MistralConfig(
        **COMMON, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=10000.0, sliding_window=None))


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=False, rope_theta=1e6, sliding_window=None,
        num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.02))


def qwen2_tied():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **COMMON, num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6, use_sliding_window=False,
        sliding_window=32, max_window_layers=2))


def qwen3_untied():
    """Qwen3's head dimension is its own (here 16 with hidden 64 and 8 heads, not 8)."""
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **COMMON, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rope_theta=1e6,
        use_sliding_window=False, sliding_window=None, max_window_layers=2))


def random_hf_model(make, seed: int = 0):
    torch.manual_seed(seed)
    model = make().eval()
    with torch.no_grad():  # norms away from 1, so that a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):  # biases start at zero: make them matter
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_tokenizer(directory) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "unk_token": "<unk>"}))


def logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize("make,arch", [(llama3, "llama"), (mistral_tied, "mistral"), (qwen2_tied, "qwen2"),
                                       (qwen3_untied, "qwen3"), (llama_yarn, "llama"), (qwen3_yarn, "qwen3")],
                         ids=["llama3", "mistral", "qwen2", "qwen3", "llama-yarn", "qwen3-yarn"])
def test_hf_round_trip(tmp_path, make, arch):
    reference = random_hf_model(make)
    hf_in, ckpt, hf_out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_out"
    reference.save_pretrained(hf_in, max_shard_size="60KB")  # sharded input with an index
    assert (hf_in / "model.safetensors.index.json").is_file()
    write_tokenizer(hf_in)

    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt)]) == 0
    model, tokenizer = load_for_inference(ckpt, "cpu")
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    ref_logits = logits(reference, tokens)
    torch.testing.assert_close(logits(model, tokens), ref_logits, rtol=0, atol=1e-5)
    assert tokenizer.encode("w5 w7") == [5, 7] and tokenizer.eod == 2

    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(hf_out), "--hf-architecture", arch,
                         "--max-shard-size", "80KB"]) == 0
    config = json.loads((hf_out / "config.json").read_text())
    assert config["architectures"] == [type(reference).__name__]
    assert (config["eos_token_id"], config["bos_token_id"]) == (2, 1)
    again = type(reference).from_pretrained(hf_out).eval()
    ref_state, state = reference.state_dict(), again.state_dict()
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        assert torch.equal(ref_state[name], state[name]), name
    torch.testing.assert_close(logits(again, tokens), ref_logits, rtol=0, atol=0)
    # transformers 5 gives the qwen model types their own tokenizer class whatever tokenizer_config.json names, which
    # cannot read this test's word-level tokenizer; the exported files themselves are the same for every model.
    tokenizer_class = (transformers.PreTrainedTokenizerFast if arch.startswith("qwen")
                       else transformers.AutoTokenizer)
    hf_tok = tokenizer_class.from_pretrained(hf_out)
    assert hf_tok("w5 w7", add_special_tokens=False)["input_ids"] == [5, 7]


def test_converted_checkpoint_resumes_training(tmp_path):
    """A converted checkpoint has no optimizer state: loading it for training starts fresh moments."""
    hf_in, ckpt = tmp_path / "hf", tmp_path / "ckpt"
    random_hf_model(llama3).save_pretrained(hf_in)
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt)]) == 0
    from meshtron.checkpoint.metadata import read_config
    from ckpt_helpers import make_optimizer

    cfg = read_config(ckpt / "iter_0000000")
    cfg.set("mock_data", True)
    cfg.set("device", "cpu")
    validate_config(cfg, 1)
    ctx = ParallelContext()
    from meshtron.model import GPTModel
    from meshtron.parallel.sharding import initialize_parameters

    model = GPTModel(cfg.model, ctx, VOCAB)
    initialize_parameters(model, 0, torch.device("cpu"), torch.float32)
    optimizer, _ = make_optimizer(cfg, [model])
    state = load_checkpoint(str(ckpt), [model], optimizer, ctx, cfg)
    assert state.iteration == 0 and state.rng is None and optimizer.step_count == 0


def test_conversion_errors(tmp_path, capsys):
    cfg = tiny_config(normalization="LayerNorm", swiglu=False, disable_bias_linear=False,
                      position_embedding_type="learned_absolute")
    ctx = ParallelContext()
    save_checkpoint(str(tmp_path / "gpt"), TrainingState(iteration=1), build_chunks(cfg, ctx), None, ctx, cfg)
    assert convert_main(["--to", "hf", "--input", str(tmp_path / "gpt"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "cannot be written as a Hugging Face Llama model" in err
    assert "--normalization LayerNorm" in err and "no --swiglu" in err and "linear biases" in err

    assert convert_main(["--from", "hf", "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "x")]) == 2
    assert "config.json not found" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        convert_main(["--from", "hf", "--to", "hf", "--input", "a", "--output", "b"])
    assert convert_main(["--to", "hf", "--input", str(tmp_path / "gpt"), "--output", str(tmp_path / "gpt")]) == 2
    assert "is not an empty directory" in capsys.readouterr().err


def moe_model_from_checkpoint(ckpt):
    """The converted MoE checkpoint as a whole fp32 CPU model (MoE layers built from its configuration)."""
    from meshtron.checkpoint.load import load_model_tensors, resolve_checkpoint
    from meshtron.checkpoint.metadata import read_config
    from meshtron.layers.moe import moe_mlp_factory
    from meshtron.model import GPTModel
    from meshtron.parallel.sharding import initialize_parameters

    ckpt_dir = resolve_checkpoint(ckpt)
    cfg = read_config(ckpt_dir)
    model = GPTModel(cfg.model, ParallelContext(), VOCAB, make_mlp=moe_mlp_factory(cfg))
    initialize_parameters(model, 0, torch.device("cpu"), torch.float32)
    load_model_tensors([model], ckpt_dir, None, no_dist=True)
    return model.eval(), cfg


def test_hf_mixtral_round_trip(tmp_path):
    """Mixtral: router and experts map onto meshtron's MoE layer; same logits, identical tensors back."""
    reference = random_hf_model(mixtral)
    hf_in, ckpt, hf_out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "hf_out"
    reference.save_pretrained(hf_in)
    assert convert_main(["--from", "hf", "--input", str(hf_in), "--output", str(ckpt)]) == 0
    model, cfg = moe_model_from_checkpoint(ckpt)
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (4, 2, 96)
    assert (m.moe_router_score_function, m.moe_router_pre_softmax, m.moe_expert_capacity_factor) == (
        "softmax", False, None)
    assert m.moe_aux_loss_coeff == pytest.approx(0.02)
    tokens = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    ref_logits = logits(reference, tokens)
    torch.testing.assert_close(logits(model, tokens), ref_logits, rtol=0, atol=1e-5)

    # no --hf-architecture: an MoE checkpoint is exported as Mixtral
    assert convert_main(["--to", "hf", "--input", str(ckpt), "--output", str(hf_out)]) == 0
    config = json.loads((hf_out / "config.json").read_text())
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 96)
    again = transformers.MixtralForCausalLM.from_pretrained(hf_out).eval()
    ref_state, state = reference.state_dict(), again.state_dict()
    assert ref_state.keys() == state.keys()
    for name in ref_state:
        assert torch.equal(ref_state[name], state[name]), name
    torch.testing.assert_close(logits(again, tokens), ref_logits, rtol=0, atol=0)


def test_hf_mixtral_fused_expert_tensors(tmp_path):
    """transformers 5's fused expert tensors (gate_up_proj, down_proj) split into the same canonical tensors."""
    from safetensors.torch import save_file
    from meshtron.checkpoint.convert import read_hf_tensors

    reference = random_hf_model(mixtral)
    legacy, fused, ckpt_a, ckpt_b = (tmp_path / n for n in ("legacy", "fused", "a", "b"))
    reference.save_pretrained(legacy)
    fused.mkdir()
    (fused / "config.json").write_text((legacy / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(fused / "model.safetensors"))
    assert any(k.endswith("experts.gate_up_proj") for k in read_hf_tensors(fused))
    for src, dst in ((legacy, ckpt_a), (fused, ckpt_b)):
        assert convert_main(["--from", "hf", "--input", str(src), "--output", str(dst)]) == 0
    model_a, _ = moe_model_from_checkpoint(ckpt_a)
    model_b, _ = moe_model_from_checkpoint(ckpt_b)
    state_a, state_b = model_a.state_dict(), model_b.state_dict()
    for name in state_a:
        assert torch.equal(state_a[name], state_b[name]), name


def test_mixtral_export_errors(tmp_path, capsys):
    """MoE features Mixtral cannot express are listed; a dense model is not Mixtral, nor an MoE model Llama."""
    from meshtron.layers.moe import moe_mlp_factory
    from meshtron.model import GPTModel
    from meshtron.parallel.sharding import initialize_parameters

    ctx = ParallelContext()
    cfg = tiny_config(num_experts=4, moe_router_topk=2, moe_router_pre_softmax=True, moe_expert_capacity_factor=1.0,
                      moe_shared_expert_intermediate_size=32)
    model = GPTModel(cfg.model, ctx, 100, make_mlp=moe_mlp_factory(cfg))
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    moe = str(tmp_path / "moe")
    save_checkpoint(moe, TrainingState(iteration=1), [model], None, ctx, cfg)
    assert convert_main(["--to", "hf", "--input", moe, "--output", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "cannot be written as a Hugging Face Mixtral model" in err
    assert "--moe-router-pre-softmax" in err and "--moe-expert-capacity-factor 1.0" in err
    assert "shared experts" in err
    assert convert_main(["--to", "hf", "--input", moe, "--output", str(tmp_path / "o2"), "--hf-architecture",
                         "llama"]) == 2
    assert "--hf-architecture mixtral" in capsys.readouterr().err

    dense_cfg = tiny_config()
    dense = str(tmp_path / "dense")
    save_checkpoint(dense, TrainingState(iteration=1), build_chunks(dense_cfg, ctx), None, ctx, dense_cfg)
    assert convert_main(["--to", "hf", "--input", dense, "--output", str(tmp_path / "o3"), "--hf-architecture",
                         "mixtral"]) == 2
    assert "no --num-experts" in capsys.readouterr().err
