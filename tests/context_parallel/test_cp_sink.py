"""Context parallelism for attention with sinks (gpt-oss), full and within a sliding window, equals one process:
the attention call (output and the gradients of q, k, v and the sinks) for every --cp-comm-type, and a tiny
gpt-oss-like model (sliding-window and full sink layers, clamped SwiGLU experts; logits, loss, token losses and
every gradient) in fp32. The window (8 keys, and 5) is as long as a chunk of the load-balanced split or shorter,
so that it crosses chunk and rank boundaries; with CP 4 whole blocks fall outside it and are skipped."""

from __future__ import annotations

import contextlib
import functools
import warnings

import pytest
import torch

from meshtron.config import ModelConfig
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.context_parallel.attention import context_parallel_attention, context_parallel_inputs
from meshtron.parallel.context_parallel.split import gather_sequence, split_sequence
from tests.context_parallel import cp_cases
from tests.layers.test_documents import flex_backward_on_cpu
from tests.layers.test_sink_attention import allowed_pairs, dense_reference

B, HEADS, GROUPS, DIM, SEQ = 2, 4, 2, 8, cp_cases.SEQ  # 32 tokens: chunks of 8 (CP 2) or 4 (CP 4)


# ----------------------------------------------------------------------------------------------- attention
def _tensors(documents: bool):
    g = torch.Generator().manual_seed(11)
    q, dout = (torch.randn(B, HEADS, SEQ, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(B, GROUPS, SEQ, DIM, generator=g) for _ in range(2))
    sinks = torch.randn(HEADS, generator=g)
    docs = cp_cases.random_documents(g, B, SEQ) if documents else None
    return q, k, v, sinks, dout, docs


def attention_reference(window, documents: bool):
    """softmax over [scores, sink] in one process: out, dq, dk, dv, dsinks."""
    q, k, v, sinks, dout, docs = _tensors(documents)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = dense_reference(*inputs, allowed_pairs(SEQ, window, docs))
    out.backward(dout)
    return (out.detach(),) + tuple(t.grad for t in inputs)


@contextlib.contextmanager
def _kernel(name: str):
    """The blocks' kernel: ``math`` (what the CPU selects) or ``flex`` (CUDA's for masked blocks, here its eager
    implementation with torch's CPU check on its backward lifted: the same block masks and backward recipe)."""
    if name == "math":
        yield
        return
    from meshtron.parallel.context_parallel import attention, kernels

    saved = attention.select_kernel
    attention.select_kernel = lambda q, masked, *a: kernels.FLEX if masked else kernels.MATH
    try:
        with flex_backward_on_cpu(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # flex attention without torch.compile
            yield
    finally:
        attention.select_kernel = saved


def _attention_case(ctx: ParallelContext, comm_type: str, window, documents: bool, kernel: str = "math"):
    q, k, v, sinks, dout, docs = _tensors(documents)
    split = lambda t: split_sequence(t, ctx.cp, ctx.cp_rank, dim=2)  # noqa: E731
    q, k, v = (split(t).clone().requires_grad_() for t in (q, k, v))
    sinks = sinks.clone().requires_grad_()
    local_docs = None if docs is None else split_sequence(docs, ctx.cp, ctx.cp_rank, dim=1)
    inputs = context_parallel_inputs(ctx, comm_type, local_docs, 2 if comm_type == "a2a+p2p" else None)
    with _kernel(kernel):
        out = context_parallel_attention(q, k, v, inputs, sinks=sinks, window=window)
        out.backward(split(dout))
    full = lambda t: gather_sequence(t.detach(), ctx.cp_group, dim=2)  # noqa: E731
    dsinks = sinks.grad.clone()
    torch.distributed.all_reduce(dsinks, group=ctx.cp_group)  # each rank's queries' share
    return full(out), full(q.grad), full(k.grad), full(v.grad), dsinks


# (comm type, window, documents[, kernel]) by CP size
ATTENTION_CASES = {
    2: [(c, w, False) for c in ("p2p", "allgather", "a2a") for w in (None, 8, 5)]
    + [("p2p", 5, True), ("allgather", 8, True), ("a2a", 5, True)],
    # flex attention's eager CPU implementation takes seconds a call: with the slow world only
    4: [(c, w, d) for c in ("p2p", "allgather", "a2a+p2p") for w, d in ((None, False), (5, False), (3, True))]
    + [("p2p", 3, False, "flex"), ("allgather", 5, True, "flex")],
}


# ----------------------------------------------------------------------------------------------- model
def gpt_oss_cfg() -> ModelConfig:
    """A tiny gpt-oss: alternating sliding-window (8 keys) and full sink layers, biases, YaRN, clamped experts."""
    return ModelConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, group_query_attention=True, num_query_groups=2,
        kv_channels=8, seq_length=SEQ, normalization="RMSNorm", swiglu=True, position_embedding_type="rope",
        disable_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=True,
        make_vocab_size_divisible_by=8, layer_pattern="sink_window+oss_moe,sink+oss_moe", sliding_window_size=8,
        rope_type="yarn", rotary_scaling_factor=4.0, yarn_original_max_position_embeddings=8, mscale=1.0,
        mscale_all_dim=0.0, yarn_truncate=False, num_experts=4, moe_ffn_hidden_size=16, ffn_hidden_size=16,
        moe_router_topk=2, moe_aux_loss_coeff=1e-2, swiglu_clamp_limit=1.5)


# (name, TP, sequence parallel, comm type, documents) by world size
MODEL_CASES = {
    2: [("cp2-p2p", 1, False, "p2p", False), ("cp2-allgather", 1, False, "allgather", False),
        ("cp2-a2a", 1, False, "a2a", False), ("cp2-p2p-documents", 1, False, "p2p", True)],
    4: [("tp2-sp-cp2-p2p", 2, True, "p2p", False), ("tp2-cp2-a2a-documents", 2, False, "a2a", True),
        ("cp4-allgather", 1, False, "allgather", False), ("cp4-a2a+p2p", 1, False, "a2a+p2p", False)],
}


@functools.lru_cache(maxsize=None)
def model_reference(documents: bool):
    return cp_cases.run_model(gpt_oss_cfg(), ParallelContext(), False, "p2p", documents)


def suite_worker(rank: int, world: int) -> dict:
    out: dict = {}
    cp_ctx = build_groups(1, world, 1, 1, torch.device("cpu"))
    for case in ATTENTION_CASES[world]:
        out[("attention",) + case] = _attention_case(cp_ctx, *case)
    contexts = {1: cp_ctx}
    for name, tp, sp, comm, docs in MODEL_CASES[world]:
        ctx = cp_cases.groups_for_tp(contexts, tp, world)
        out[("model", name)] = cp_cases.run_model(gpt_oss_cfg(), ctx, sp, comm, docs)
    return out


# ----------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("cp,window", [(2, 8), (4, 5), (4, 3), (4, 1)])
def test_blocks_are_skipped_exactly_when_the_window_hides_them(cp, window):
    """A ring or all-gather block is skipped iff no query of it sees any key of it (the window, at the split's
    sequence positions); with CP 4 some are."""
    from meshtron.parallel.context_parallel.attention import (ContextParallelInputs, _Masks, _rows, allgather_plan,
                                                              ring_plan)
    from meshtron.parallel.context_parallel.split import local_token_indices

    local = SEQ // cp
    pos = [local_token_indices(local, cp, r) for r in range(cp)]
    skipped = 0
    for rank in range(cp):
        masks = _Masks(ContextParallelInputs(None, cp, rank, "p2p"), local, torch.device("cpu"), window, batch=1)
        for block in ring_plan(cp, rank) + allgather_plan(cp, rank):
            q = pos[rank][_rows(block.q_rows, local // 2)]
            k_rows = _rows(block.k_rows, local // 2)
            k = torch.arange(k_rows.start, k_rows.stop) if block.source is None else pos[block.source][k_rows]
            visible = ((k[None] <= q[:, None]) & (q[:, None] - k[None] < window)).any()
            assert masks.empty(block) == (not visible), (rank, block)
            skipped += masks.empty(block)
    assert (skipped > 0) == (cp == 4)


@pytest.fixture(scope="module")
def worlds() -> dict:
    return {}


def _results(worlds: dict, world: int) -> list[dict]:
    return cp_cases.results_of(worlds, world, suite_worker)


_close = cp_cases.assert_close


def _case_id(case) -> str:
    return "-".join([case[0], f"window{case[1]}"] + ["documents"] * case[2] + list(case[3:]))


def _check_attention(worlds, world: int, case) -> None:
    comm, window, documents = case[:3]
    ref = attention_reference(window, documents)
    for rank, res in enumerate(_results(worlds, world)):
        for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), res[("attention",) + case], ref):
            _close(got, want, f"cp={world} rank {rank} {case} {name}")


def _check_model(worlds, world: int, case) -> None:
    name, _, _, _, documents = case
    reference = model_reference(documents)
    ref_grads = reference[3]
    assert any(k.endswith("sinks") for k in ref_grads)
    cp_cases.assert_model_matches(_results(worlds, world), name, reference)


@pytest.mark.parametrize("case", ATTENTION_CASES[2], ids=_case_id)
def test_cp2_sink_attention_matches_one_process(worlds, case):
    _check_attention(worlds, 2, case)


@pytest.mark.parametrize("case", MODEL_CASES[2], ids=lambda c: c[0])
def test_cp2_gpt_oss_model_matches_one_process(worlds, case):
    _check_model(worlds, 2, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", ATTENTION_CASES[4], ids=_case_id)
def test_cp4_sink_attention_matches_one_process(worlds, case):
    _check_attention(worlds, 4, case)


@pytest.mark.slow
@pytest.mark.parametrize("case", MODEL_CASES[4], ids=lambda c: c[0])
def test_tp2_cp2_and_cp4_gpt_oss_model_matches_one_process(worlds, case):
    _check_model(worlds, 4, case)
