"""Multi-latent attention: the math against Hugging Face's DeepSeek-V3, parallel layouts (TP + SP, CP ring and
all-gather, PP through the trainer, compiled layers: slow) against one process, validation, and FLOPs/parameter counts.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.errors import ConfigError
from meshtron.layers.mla_hf import attention_from_hf, attention_to_hf
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.sharding import cut, initialize_parameters, spec_of
from meshtron.validation import validate_config
from tests.context_parallel.cp_cases import run_model
from tests.distributed.launch import run_distributed


def mla_cfg(**kw) -> ModelConfig:
    """A tiny DeepSeek-style model: every head dim different, so that a swapped dim cannot pass."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=32,
                      normalization="RMSNorm", norm_epsilon=1e-6, swiglu=True, position_embedding_type="rope",
                      disable_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0,
                      untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=8,
                      multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=16, qk_head_dim=6,
                      qk_pos_emb_head_dim=4, v_head_dim=5)
    return dataclasses.replace(cfg, **kw)


YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=1.0,
            yarn_original_max_position_embeddings=8)


# ----------------------------------------------------------------------------------------------- Hugging Face
def _hf_model(cfg: ModelConfig, vocab: int, interleave: bool):
    transformers = pytest.importorskip("transformers")
    yarn = cfg.rope_type == "yarn"
    rope = ({"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": cfg.rotary_scaling_factor,
             "original_max_position_embeddings": cfg.yarn_original_max_position_embeddings, "mscale": cfg.mscale,
             "mscale_all_dim": cfg.mscale_all_dim, "beta_fast": cfg.yarn_beta_fast, "beta_slow": cfg.yarn_beta_slow}
            if yarn else {"rope_type": "default", "rope_theta": cfg.rotary_base})
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, first_k_dense_replace=cfg.num_layers, n_routed_experts=4,
        moe_intermediate_size=8, q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_head_dim, qk_rope_head_dim=cfg.qk_pos_emb_head_dim, v_head_dim=cfg.v_head_dim,
        max_position_embeddings=64, rms_norm_eps=cfg.norm_epsilon, tie_word_embeddings=False,
        attention_bias=False, rope_parameters=rope, rope_interleave=interleave)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norms away from 1 and larger weights, so that every tensor matters
        for name, p in model.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))
    return model


def _meshtron_tensors(hf_state: dict, cfg: ModelConfig, interleave: bool) -> dict:
    """Canonical meshtron tensors of a Hugging Face DeepSeek state dict (dense layers)."""
    out = {"embedding.word_embeddings.weight": hf_state["model.embed_tokens.weight"],
           "final_norm.weight": hf_state["model.norm.weight"], "output.weight": hf_state["lm_head.weight"]}
    layer_names = {"input_layernorm.weight": "input_norm.weight",
                   "post_attention_layernorm.weight": "post_attention_norm.weight",
                   "mlp.gate_proj.weight": "mlp.gate.weight", "mlp.up_proj.weight": "mlp.up.weight",
                   "mlp.down_proj.weight": "mlp.down.weight"}
    for i in range(cfg.num_layers):
        prefix = f"model.layers.{i}."
        attn = {k[len(prefix + "self_attn."):]: v for k, v in hf_state.items() if k.startswith(prefix + "self_attn.")}
        for k, v in attention_from_hf(attn, cfg, interleave).items():
            out[f"layers.{i}.attention.{k}"] = v
        for k, v in layer_names.items():
            out[f"layers.{i}.{v}"] = hf_state[prefix + k]
    return out


def _load_canonical(model: torch.nn.Module, tensors: dict) -> None:
    with torch.no_grad():
        for p in model.parameters():
            spec = spec_of(p)
            p.copy_(torch.cat([cut(tensors[piece.name], piece) for piece in spec.pieces], dim=spec.cat_dim))


HF_CASES = {
    "yarn-q-lora-interleaved": (mla_cfg(**YARN), True),
    "rope-no-q-lora": (mla_cfg(q_lora_rank=None, rope_type="rope"), False),
}


@pytest.mark.parametrize("case", HF_CASES)
def test_logits_match_hugging_face_deepseek_v3(case):
    cfg, interleave = HF_CASES[case]
    vocab = 96
    hf = _hf_model(cfg, vocab, interleave)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = GPTModel(cfg, ParallelContext(), vocab)
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    tensors = _meshtron_tensors(hf_state, cfg, interleave)
    assert {p.name for q in model.parameters() for p in spec_of(q).pieces} == set(tensors)
    _load_canonical(model, tensors)
    tokens = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(tokens).logits
        got = model(tokens)
    assert want.abs().max() > 1  # not a degenerate comparison
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The name map goes both ways.
    layer0 = {k[len("layers.0.attention."):]: v for k, v in tensors.items() if k.startswith("layers.0.attention.")}
    back = attention_to_hf(layer0, cfg, interleave)
    for k, v in back.items():
        torch.testing.assert_close(v, hf_state[f"model.layers.0.self_attn.{k}"], rtol=0, atol=0)


def test_interleaved_checkpoint_needs_the_row_permutation():
    """Without reordering the rotary rows, an interleaved checkpoint gives other logits (the test above can fail)."""
    cfg = mla_cfg(**YARN)
    hf = _hf_model(cfg, 96, True)
    hf_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = GPTModel(cfg, ParallelContext(), 96)
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    _load_canonical(model, _meshtron_tensors(hf_state, cfg, interleave=False))
    tokens = torch.randint(0, 96, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max() > 1e-3


# ----------------------------------------------------------------------------------------------- parallel
#: (name, model, TP, CP, sequence parallel, CP comm type, documents), all on two ranks
LAYOUTS = [
    ("tp2-sp", mla_cfg(**YARN), 2, 1, True, "p2p", False),
    ("tp2-no-q-lora", mla_cfg(q_lora_rank=None, disable_bias_linear=False), 2, 1, False, "p2p", False),
    ("cp2-ring", mla_cfg(**YARN), 1, 2, False, "p2p", False),
    ("cp2-allgather", mla_cfg(**YARN), 1, 2, False, "allgather", False),
    ("cp2-ring-documents", mla_cfg(), 1, 2, False, "p2p", True),
]


def _pipeline_config(pp: int) -> MeshtronConfig:
    cfg = MeshtronConfig(model=mla_cfg(num_layers=4, seq_length=8, vocab_size=96))
    cfg.parallel.pipeline_model_parallel_size = pp
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 4, 3, 5, "cpu"
    t.eval_interval, t.eval_iters, t.compile, t.generate_sample = 3, 1, False, False
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.adam_eps = 1e-2, 0, 1e-5
    cfg.log.log_interval, cfg.log.quiet, cfg.log.progress_bar = 1, True, False
    return cfg


def _layouts_worker(rank: int, world: int) -> dict:
    from meshtron.training.trainer import run_training

    out = {}
    for name, cfg, tp, cp, sp, comm, docs in LAYOUTS:
        ctx = build_groups(tp, cp, 1, 1, torch.device("cpu"))
        out[name] = run_model(cfg, ctx, sp, comm, docs)
    result = run_training(_pipeline_config(2))
    out["pp2-trainer"] = (result.train_losses, result.eval_losses)
    return out


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(_layouts_worker, 2, timeout=300)


@pytest.mark.parametrize("layout", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_parallel_layout_matches_one_process(layouts, layout):
    name, cfg, _, _, _, _, docs = layout
    ref_logits, ref_total, ref_losses, ref_grads = run_model(cfg, ParallelContext(), False, "p2p", docs)
    assert len(ref_grads) > 20 and all(g.abs().sum() > 0 for g in ref_grads.values())
    for rank, results in enumerate(layouts):
        logits, total, losses, grads = results[name]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for key in ref_grads:
            torch.testing.assert_close(grads[key], ref_grads[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {key}: {m}")


def test_pipeline_trainer_logs_the_single_process_losses(layouts):
    from meshtron.training.trainer import run_training

    ref = run_training(_pipeline_config(1))
    assert len(ref.train_losses) == 3
    for rank, results in enumerate(layouts):
        train, evals = results["pp2-trainer"]
        assert train == pytest.approx(ref.train_losses, rel=1e-5), f"rank {rank}"
        assert evals == pytest.approx(ref.eval_losses, rel=1e-5), f"rank {rank}"


# Slow: the tp2-sp layout runs eager by default (test_parallel_layout_matches_one_process) and compiled TP + SP
# layers run in tests/parallel/test_compiled_parallel.py.
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                    reason="torch.compile on CPU needs a C++ compiler")
def test_compiled_layers_with_tensor_and_sequence_parallelism_match_one_process():
    from tests.parallel.test_compiled_parallel import compiled_layout_failures

    model = mla_cfg(num_layers=2, seq_length=8, **YARN)
    failures = compiled_layout_failures("cpu", "gloo", rtol=1e-5, atol=1e-6,
                                        cases_by_name={"mla-tp2-sp": (model, dict(tp=2, sp=True), True)})
    assert not failures, "\n".join(failures)


# ----------------------------------------------------------------------------------------------- counts, CLI
@pytest.mark.parametrize("q_lora,bias", [(12, False), (None, True)])
def test_parameter_counts_match_the_built_model(q_lora, bias):
    from meshtron.presets import count_parameters

    cfg = mla_cfg(q_lora_rank=q_lora, disable_bias_linear=not bias, normalization="LayerNorm" if bias else "RMSNorm")
    model = GPTModel(cfg, ParallelContext(), 96)  # meta device: canonical shapes only
    shapes = {p.name: p.full_shape for q in model.parameters() for p in spec_of(q).pieces}
    numel = {name: torch.Size(shape).numel() for name, shape in shapes.items()}
    # Matmul weights: every 2-D tensor but the input embedding (the output layer is its own, untied).
    matmul = sum(n for name, n in numel.items() if len(shapes[name]) == 2 and name != "embedding.word_embeddings.weight")
    counts = count_parameters(cfg, 96)
    assert counts["total"] == sum(numel.values())
    assert counts["matmul"] == matmul


def test_flops_count_mla_matmuls_and_attention_by_head_dims():
    from meshtron.training.metrics import flops_per_token

    # DeepSeek-V3's attention shapes, by hand.
    H, n, rq, rkv, dn, dr, dv, L, S, V, F = 7168, 128, 1536, 512, 128, 64, 128, 2, 4096, 129280, 18432
    cfg = mla_cfg(num_layers=L, hidden_size=H, num_attention_heads=n, ffn_hidden_size=F, seq_length=S,
                  q_lora_rank=rq, kv_lora_rank=rkv, qk_head_dim=dn, qk_pos_emb_head_dim=dr, v_head_dim=dv)
    attention = H * rq + rq * n * (dn + dr) + H * (rkv + dr) + rkv * n * (dn + dv) + n * dv * H
    assert attention == 187_105_280
    matmul = L * (attention + 3 * H * F) + V * H
    assert flops_per_token(cfg, V) == 6 * matmul + 6 * L * S * n * ((dn + dr) + dv)


def test_train_command_runs_mla_and_reports_its_flops(tmp_path, monkeypatch):
    import json

    from meshtron.cli import main
    from meshtron.training.metrics import flops_per_token

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    metrics = tmp_path / "metrics.jsonl"
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
             "--seq-length", "16", "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
             "--multi-latent-attention", "--q-lora-rank", "12", "--kv-lora-rank", "16", "--qk-head-dim", "6",
             "--qk-pos-emb-head-dim", "4", "--v-head-dim", "5", "--rotary-scaling-factor", "4"]
    run = ["--vocab-size", "96", "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "2",
           "--train-iters", "3", "--log-interval", "1", "--device", "cpu", "--no-compile", "--eval-iters", "0",
           "--metrics-file", str(metrics)]
    assert main(["train", *flags, *run]) == 0
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if r["type"] == "train"]
    assert len(train) == 3 and all(r["loss"] > 0 for r in train)
    cfg = mla_cfg(num_layers=2, seq_length=16, normalization="RMSNorm", rotary_scaling_factor=4.0)
    expected = flops_per_token(cfg, 96)
    for r in train:
        assert r["tflops_per_gpu"] * 1e12 / r["tokens_per_sec_per_gpu"] == pytest.approx(expected, rel=1e-9)


# ----------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("change,flag", [
    (dict(group_query_attention=True, num_query_groups=2), "--group-query-attention"),
    (dict(position_embedding_type="learned_absolute"), "--position-embedding-type"),
    (dict(qk_pos_emb_head_dim=3), "--qk-pos-emb-head-dim"),
    (dict(kv_lora_rank=0), "--kv-lora-rank"),
    (dict(q_lora_rank=0), "--q-lora-rank"),
    (dict(qk_layernorm=True), "--qk-layernorm"),
    (dict(multi_latent_attention=False, rope_type="yarn", position_embedding_type="learned_absolute"), "--rope-type"),
    (dict(use_rope_scaling=True), "--use-rope-scaling"),
])
def test_bad_mla_settings_name_the_flag(change, flag):
    cfg = MeshtronConfig(model=mla_cfg(vocab_size=96, **change))
    with pytest.raises(ConfigError, match=flag):
        validate_config(cfg)


def test_mla_heads_must_divide_over_tensor_parallel_ranks():
    cfg = MeshtronConfig(model=mla_cfg(vocab_size=96, num_attention_heads=6, hidden_size=36))
    cfg.parallel.tensor_model_parallel_size = 4
    with pytest.raises(ConfigError, match="--num-attention-heads"):
        validate_config(cfg, world_size=4)


@pytest.mark.parametrize("q_lora", [12, None])
def test_memory_estimate_counts_one_ranks_mla_parameters(q_lora):
    from meshtron.layers.mla import MultiLatentAttention
    from meshtron.layer_kinds.base import mlp_rank_parameters
    from meshtron.memory import layer_parameters

    cfg = mla_cfg(q_lora_rank=q_lora, disable_bias_linear=False)
    with torch.device("meta"):
        local = sum(p.numel() for p in MultiLatentAttention(cfg, ParallelContext(tp=2, tp_rank=1), "a", False)
                    .parameters())
    dense, _ = layer_parameters(cfg, 0, tp=2)
    norms = 2 * cfg.hidden_size  # the layer's two RMSNorm weights
    assert dense == local + norms + mlp_rank_parameters(cfg, cfg.ffn_hidden_size, 2)


def test_incremental_decoding_with_the_kv_cache_matches_the_full_forward():
    cfg = mla_cfg(**YARN)
    model = GPTModel(cfg, ParallelContext(), 96)
    initialize_parameters(model, 2, torch.device("cpu"), torch.float32)
    model.eval()
    tokens = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(tokens)
        caches: dict = {}
        steps = [model(tokens[:, :6], caches=caches)]
        for i in range(6, 9):
            steps.append(model(tokens[:, i:i + 1], caches=caches, position_offset=i))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
