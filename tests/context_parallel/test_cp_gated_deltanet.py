"""Context parallelism for gated DeltaNet (Qwen3.5's linear attention) equals one process, in fp32: the layer
alone (output, input gradient and every parameter's gradient; one sequence and packed documents with a
document starting exactly at a chunk boundary) and a tiny Qwen3.5-like model of gdn and gated attention layers
(logits, loss, token losses and every gradient) under CP 2 (CP 4 and TP 2 x CP 2: slow)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from meshtron.config import ModelConfig
from meshtron.layers.documents import DocumentMask
from meshtron.layers.gated_deltanet import GatedDeltaNet
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.context_parallel.attention import context_parallel_inputs
from meshtron.parallel.context_parallel.split import gather_sequence, split_sequence
from meshtron.parallel.sharding import gather_canonical, initialize_parameters
from tests.context_parallel import cp_cases

B, HIDDEN = 2, 32
LAYER_SEQ = 272  # CP 2: chunks of 68 tokens (two of the kernel's 64-token chunks, one padded); CP 4: 34


# ----------------------------------------------------------------------------------------------- the layer
def _layer(ctx: ParallelContext) -> GatedDeltaNet:
    layer = GatedDeltaNet(ctx, "mixer", hidden_size=HIDDEN, num_key_heads=2, num_value_heads=4, key_head_dim=8,
                          value_head_dim=6, conv_kernel_size=4, kernel="chunk")
    initialize_parameters(layer, 3, torch.device("cpu"), torch.float32)
    with torch.no_grad():  # decays and betas away from their initial values, so that the state carries far
        for name, p in layer.named_parameters():
            if name in ("A_log", "dt_bias", "norm_weight"):
                p.add_(torch.linspace(-1.0, 0.5, p.numel()).view_as(p))
    return layer


def _layer_tensors(documents: bool, cp: int):
    g = torch.Generator().manual_seed(5)
    x, dout = (torch.randn(LAYER_SEQ, B, HIDDEN, generator=g) for _ in range(2))
    docs = None
    if documents:  # row 0: a document starts at the first token of chunk 1; row 1: one token later (the halo)
        docs = cp_cases.random_documents(g, B, LAYER_SEQ)
        n = LAYER_SEQ // (2 * cp)
        docs[0, n:] += 100
        docs[1, n + 1:] += 100
    return x, dout, docs


def _layer_grads(layer, ctx: ParallelContext) -> dict:
    if ctx.cp_group is not None:  # each rank's tokens' share (summed before gathering: rank 0's piece wins)
        for p in layer.parameters():
            dist.all_reduce(p.grad, group=ctx.cp_group)
    return gather_canonical([layer], "grad")


def layer_run(ctx: ParallelContext, documents: bool, cp: int):
    """(output, input gradient, parameter gradients) in sequence order; one process when ``ctx.cp`` is 1."""
    x, dout, docs = _layer_tensors(documents, cp)
    layer = _layer(ctx)
    if ctx.cp > 1:
        x, dout = (split_sequence(t, ctx.cp, ctx.cp_rank, dim=0) for t in (x, dout))
        local_docs = None if docs is None else split_sequence(docs, ctx.cp, ctx.cp_rank, dim=1)
        mask = context_parallel_inputs(ctx, "p2p", local_docs)
    else:
        mask = None if docs is None else DocumentMask.causal(docs)
    x = x.clone().requires_grad_()
    out = layer(x, mask=mask)
    out.backward(dout)
    full = lambda t: gather_sequence(t.detach(), ctx.cp_group, dim=0)  # noqa: E731
    return full(out), full(x.grad), _layer_grads(layer, ctx)


@functools.lru_cache(maxsize=None)
def layer_reference(documents: bool, cp: int):
    return layer_run(ParallelContext(), documents, cp)


# ----------------------------------------------------------------------------------------------- the model
def qwen3_5_cfg() -> ModelConfig:
    """Four layers (gdn, gated attention, gdn, gated attention) as tests/moe/test_qwen3_5_layouts.py's."""
    m = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, group_query_attention=True,
                    num_query_groups=2, kv_channels=16, ffn_hidden_size=48, seq_length=cp_cases.SEQ,
                    normalization="RMSNorm", swiglu=True, position_embedding_type="rope", disable_bias_linear=True,
                    hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
                    make_vocab_size_divisible_by=8)
    m.zero_centred_norm, m.rotary_percent = True, 0.25
    m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim = 2, 4, 8, 6
    m.layer_pattern = "gdn+dense,gated_attn+dense,gdn+dense,gated_attn+dense"
    return m


@functools.lru_cache(maxsize=None)
def model_reference(documents: bool):
    return cp_cases.run_model(qwen3_5_cfg(), ParallelContext(), False, "p2p", documents)


# (name, TP, sequence parallel, comm type, documents) by world size
MODEL_CASES = {
    2: [("cp2-p2p", 1, False, "p2p", False), ("cp2-allgather-documents", 1, False, "allgather", True)],
    4: [("cp4-p2p-documents", 1, False, "p2p", True), ("tp2-sp-cp2-p2p", 2, True, "p2p", False),
        ("cp4-a2a", 1, False, "a2a", False)],
}


def suite_worker(rank: int, world: int) -> dict:
    out: dict = {}
    contexts = {1: build_groups(1, world, 1, 1, torch.device("cpu"))}
    for documents in (False, True):
        out[("layer", documents)] = layer_run(contexts[1], documents, world)
    for name, tp, sp, comm, docs in MODEL_CASES[world]:
        ctx = cp_cases.groups_for_tp(contexts, tp, world)
        out[("model", name)] = cp_cases.run_model(qwen3_5_cfg(), ctx, sp, comm, docs)
    return out


# ----------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def worlds() -> dict:
    return {}


def _results(worlds: dict, world: int) -> list[dict]:
    return cp_cases.results_of(worlds, world, suite_worker)


_close = cp_cases.assert_close


def _check_layer(worlds, world: int, documents: bool) -> None:
    ref_out, ref_dx, ref_grads = layer_reference(documents, world)
    for rank, res in enumerate(_results(worlds, world)):
        out, dx, grads = res[("layer", documents)]
        _close(out, ref_out, f"cp={world} rank {rank} output")
        _close(dx, ref_dx, f"cp={world} rank {rank} input gradient")
        assert grads.keys() == ref_grads.keys()
        for key in ref_grads:
            _close(grads[key], ref_grads[key], f"cp={world} rank {rank} grad {key}")


def _check_model(worlds, world: int, case) -> None:
    name, _, _, _, documents = case
    reference = model_reference(documents)
    ref_grads = reference[3]
    assert any("in_proj_qkv" in k for k in ref_grads)
    cp_cases.assert_model_matches(_results(worlds, world), name, reference)


@pytest.mark.parametrize("documents", [False, True], ids=["one-sequence", "documents"])
def test_cp2_gated_deltanet_layer_matches_one_process(worlds, documents):
    _check_layer(worlds, 2, documents)


@pytest.mark.parametrize("case", MODEL_CASES[2], ids=lambda c: c[0])
def test_cp2_qwen3_5_model_matches_one_process(worlds, case):
    _check_model(worlds, 2, case)


@pytest.mark.slow
@pytest.mark.parametrize("documents", [False, True], ids=["one-sequence", "documents"])
def test_cp4_gated_deltanet_layer_matches_one_process(worlds, documents):
    _check_layer(worlds, 4, documents)


@pytest.mark.slow
@pytest.mark.parametrize("case", MODEL_CASES[4], ids=lambda c: c[0])
def test_cp4_and_tp2_cp2_qwen3_5_model_matches_one_process(worlds, case):
    _check_model(worlds, 4, case)


# ------------------------------------------------------------------------------- what a layer keeps under CP
SAVED_SEQ = 256


def _saved_bytes_worker(rank: int, world: int) -> float:
    """Bytes per local token a compiled gdn+dense layer keeps for its backward at CP=``world``."""
    from meshtron.model import GPTModel
    from tests.checkpoint.ckpt_helpers import tiny_config
    from tests.layers.saved_tensors import saved_storages

    ctx = build_groups(1, world, 1, 1, torch.device("cpu"))
    cfg = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      seq_length=SAVED_SEQ, layer_pattern="gdn+dense", linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
    model = GPTModel(cfg.model, ctx, 128, layer_ids=[0])
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    layer = model.layers["0"]
    layer.compile()
    local = SAVED_SEQ // world
    x = torch.randn(local, B, 64, requires_grad=True)
    inputs = context_parallel_inputs(ctx, "p2p", None)
    for _ in range(2):  # the second call runs the compiled graphs
        _, storages = saved_storages(lambda t: layer(t, None, inputs), x, params=list(model.parameters()))
    return sum(storages.values()) / (local * B)


def test_memory_model_counts_what_a_gdn_layer_keeps_under_cp():
    """The gdn kind's count under CP=2 (the halo'd convolution inputs, the widened fp32 values and outputs, the
    gathered chunk maps and composed states) within 1% of what the compiled layer keeps; what it leaves out is
    a [64, 64] mask and an index per micro-batch."""
    from meshtron.memory import layer_activation_bytes
    from tests.checkpoint.ckpt_helpers import tiny_config
    from tests.distributed.launch import run_distributed

    kept = run_distributed(_saved_bytes_worker, 2)[0]
    cfg = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      seq_length=SAVED_SEQ, layer_pattern="gdn+dense", linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8)
    local = SAVED_SEQ // 2
    counted = layer_activation_bytes(cfg.model, micro_batch=B, seq=local, act_bytes=4, compiled=True, layer=0,
                                     cp=2) / (local * B)
    one = layer_activation_bytes(cfg.model, micro_batch=B, seq=SAVED_SEQ, act_bytes=4, compiled=True, layer=0)
    assert counted > one / (SAVED_SEQ * B) * 1.3  # CP's own tensors are a real part of it
    assert abs(counted - kept) <= 0.01 * kept, (counted, kept)
