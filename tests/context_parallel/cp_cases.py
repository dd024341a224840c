"""Workers and references of the context-parallel tests (module level: pickled into spawned ranks).

Starting processes dominates the cost on two cores, so each world size runs every one
of its cases in one set of processes and returns the results keyed by case name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtron.config import MeshtronConfig, ModelConfig
from meshtron.layers.attention import attention_mask_from_documents
from meshtron.parallel.context_parallel.attention import context_parallel_attention, context_parallel_inputs
from meshtron.model import GPTModel
from meshtron.optim.buckets import build_layout
from meshtron.optim.grad_buffer import GradBuffer
from meshtron.optim.grads import GradientSync
from meshtron.parallel.context import ParallelContext, build_groups
from meshtron.parallel.context_parallel.split import gather_sequence, split_micro_batch, split_sequence
from meshtron.parallel.sharding import gather_canonical, initialize_parameters
from tests.distributed.launch import run_distributed

VOCAB = 100
SEQ = 32


# ----------------------------------------------------------------------------------------------- attention
B, HEADS, GROUPS, DIM = 2, 4, 2, 8


def random_documents(g: torch.Generator, batch: int, seq: int) -> torch.Tensor:
    """Document ids [batch, seq]: random boundaries, different per sample."""
    starts = (torch.rand(batch, seq, generator=g) < 0.15).int()
    starts[:, 0] = 0
    return starts.cumsum(1).int()


def attention_tensors(seed: int, documents: bool):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HEADS, SEQ, DIM, generator=g)
    k = torch.randn(B, GROUPS, SEQ, DIM, generator=g)
    v = torch.randn(B, GROUPS, SEQ, DIM, generator=g)
    dout = torch.randn(B, HEADS, SEQ, DIM, generator=g)
    return q, k, v, dout, random_documents(g, B, SEQ) if documents else None


def attention_reference(seed: int, documents: bool):
    """Full causal (or document-masked) attention in one process: out, dq, dk, dv."""
    q, k, v, dout, docs = attention_tensors(seed, documents)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = attention_mask_from_documents(docs) if docs is not None else None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _attention_case(ctx: ParallelContext, comm_type: str, seed: int, documents: bool):
    q, k, v, dout, docs = attention_tensors(seed, documents)
    split = lambda t: split_sequence(t, ctx.cp, ctx.cp_rank, dim=2)  # noqa: E731
    q, k, v = (split(t).clone().requires_grad_() for t in (q, k, v))
    local_docs = None if docs is None else split_sequence(docs, ctx.cp, ctx.cp_rank, dim=1)
    a2a_size = 2 if comm_type == "a2a+p2p" else None  # hierarchical: groups of 2 (CP 4: 2 x 2; CP 2: a2a alone)
    out = context_parallel_attention(q, k, v, context_parallel_inputs(ctx, comm_type, local_docs, a2a_size))
    out.backward(split(dout))
    full = lambda t: gather_sequence(t.detach(), ctx.cp_group, dim=2)  # noqa: E731
    return full(out), full(q.grad), full(k.grad), full(v.grad)


# a2a with CP 4 and 2 key/value heads repeats each of them twice (4 heads split over 4 ranks)
ATTENTION_CASES = [(comm, docs) for comm in ("p2p", "allgather", "a2a", "a2a+p2p") for docs in (False, True)]


# ----------------------------------------------------------------------------------------------- model
def llama_cfg(**kw) -> ModelConfig:
    cfg = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=8, group_query_attention=True,
                      num_query_groups=2, ffn_hidden_size=128, seq_length=SEQ, normalization="RMSNorm", swiglu=True,
                      position_embedding_type="rope", disable_bias_linear=True, hidden_dropout=0.0,
                      attention_dropout=0.0, untie_embeddings_and_output_weights=True, make_vocab_size_divisible_by=8)
    for k, v in kw.items():
        setattr(cfg, k, v)
    return cfg


def gpt_cfg() -> ModelConfig:
    """GPT-2 style: learned absolute positions, multi-head attention, biases, tied embeddings."""
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, seq_length=SEQ,
                       max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
                       make_vocab_size_divisible_by=8)


MODELS = {"llama": llama_cfg, "gpt": gpt_cfg}


def model_batch(seed: int, documents: bool) -> dict:
    """A full-sequence micro-batch as the data loader makes it (document-relative positions with documents)."""
    g = torch.Generator().manual_seed(seed)
    mb = {"tokens": torch.randint(0, VOCAB, (2, SEQ), generator=g),
          "labels": torch.randint(0, VOCAB, (2, SEQ), generator=g),
          "loss_mask": (torch.rand(2, SEQ, generator=g) > 0.2).float()}
    if documents:
        docs = random_documents(g, 2, SEQ)
        idx = torch.arange(SEQ)[None].expand(2, -1)
        first = torch.zeros_like(idx)
        for b in range(2):
            for d in docs[b].unique():
                sel = docs[b] == d
                first[b, sel] = int(idx[b, sel].min())
        mb["document_ids"], mb["position_ids"] = docs, idx - first
    return mb


def run_model(cfg: ModelConfig, ctx: ParallelContext, sp: bool, comm_type: str, documents: bool):
    """Logits, total loss, per-token losses (full sequence order) and canonical gradients."""
    model = GPTModel(cfg, ctx, VOCAB, sequence_parallel=sp, cp_comm_type=comm_type,
                     cp_a2a_size=2 if comm_type == "a2a+p2p" else None)
    initialize_parameters(model, 7, torch.device("cpu"), torch.float32)
    layout = build_layout([list(model.parameters())], ctx, bucket_size=1 << 30)  # experts: their own reduce group
    buffer = GradBuffer(layout.params, layout=layout)
    sync = GradientSync([model], layout.params, ctx, buffer)
    full = model_batch(0, documents)
    mb = split_micro_batch(full, ctx.cp, ctx.cp_rank)
    extra = {k: mb.get(k) for k in ("position_ids", "document_ids")}
    logits = model(mb["tokens"], **extra).detach()
    weight = mb["loss_mask"] / full["loss_mask"].sum()
    total, losses = model(mb["tokens"], labels=mb["labels"], loss_weight=weight, **extra)
    total.backward()
    sync.finish()
    total = total.detach().clone()
    if ctx.cp_group is not None:
        dist.all_reduce(total, group=ctx.cp_group)
    grads = gather_canonical([model], "grad")
    return (gather_sequence(logits, ctx.cp_group, dim=1), total,
            gather_sequence(losses.detach(), ctx.cp_group, dim=1), grads)


# (name, model, TP, sequence parallel, comm type, documents) by CP size
MODEL_CASES = {
    2: [("llama-cp2-p2p", "llama", 1, False, "p2p", False),
        ("llama-cp2-allgather", "llama", 1, False, "allgather", False),
        ("llama-cp2-p2p-documents", "llama", 1, False, "p2p", True),
        ("llama-cp2-allgather-documents", "llama", 1, False, "allgather", True),
        ("gpt-cp2-p2p", "gpt", 1, False, "p2p", False),
        ("llama-cp2-a2a-documents", "llama", 1, False, "a2a", True)],
    4: [("llama-cp4-p2p", "llama", 1, False, "p2p", False),
        ("llama-cp4-allgather-documents", "llama", 1, False, "allgather", True),
        ("llama-tp2-sp-cp2-p2p", "llama", 2, True, "p2p", False),
        ("llama-tp2-cp2-allgather", "llama", 2, False, "allgather", False),
        ("llama-tp2-sp-cp2-p2p-documents", "llama", 2, True, "p2p", True),
        ("llama-cp4-a2a", "llama", 1, False, "a2a", False),
        ("llama-cp4-a2a+p2p-documents", "llama", 1, False, "a2a+p2p", True),
        ("llama-tp2-sp-cp2-a2a-documents", "llama", 2, True, "a2a", True)],
}


def model_reference(model: str, documents: bool):
    return run_model(MODELS[model](), ParallelContext(), False, "p2p", documents)


# ----------------------------------------------------------------------------------------------- trainer
def trainer_config(cp: int = 1, comm_type: str = "p2p", pp: int = 1, distributed_optimizer: bool = False,
                   metrics_file=None) -> MeshtronConfig:
    cfg = MeshtronConfig()
    m = cfg.model
    m.num_layers, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, m.seq_length = 2, 32, 4, 64, 16
    m.group_query_attention, m.num_query_groups = True, 2
    m.vocab_size, m.make_vocab_size_divisible_by, m.hidden_dropout, m.attention_dropout = 128, 8, 0.0, 0.0
    m.normalization, m.swiglu, m.position_embedding_type = "RMSNorm", True, "rope"
    p = cfg.parallel
    p.context_parallel_size, p.cp_comm_type, p.pipeline_model_parallel_size = cp, comm_type, pp
    p.use_distributed_optimizer = distributed_optimizer
    t = cfg.train
    t.micro_batch_size, t.global_batch_size, t.train_iters, t.seed, t.device = 1, 4, 3, 5, "cpu"
    t.eval_interval, t.eval_iters, t.compile, t.generate_sample = 3, 1, False, False
    cfg.data.mock_data, cfg.data.num_workers = True, 0
    cfg.optim.lr, cfg.optim.lr_warmup_iters, cfg.optim.adam_eps = 1e-2, 0, 1e-5
    log = cfg.log
    log.log_interval, log.quiet, log.progress_bar, log.metrics_file = 1, True, False, metrics_file
    return cfg


# ----------------------------------------------------------------------------------------------- workers
def suite_worker(rank: int, world: int, trainer_runs: list[dict]) -> dict:
    """Every case of one world size: attention (CP = world), models, then trainer runs."""
    out: dict = {}
    cp_ctx = build_groups(1, world, 1, 1, torch.device("cpu"))
    for comm, docs in ATTENTION_CASES:
        out[("attention", comm, docs)] = _attention_case(cp_ctx, comm, 3, docs)
    contexts = {1: cp_ctx}
    for name, model, tp, sp, comm, docs in MODEL_CASES[world]:
        out[("model", name)] = run_model(MODELS[model](), groups_for_tp(contexts, tp, world), sp, comm, docs)
    from meshtron.training.trainer import run_training

    for i, run in enumerate(trainer_runs):
        result = run_training(trainer_config(**run))
        out[("trainer", i)] = (result.train_losses, result.eval_losses)
    return out


# ----------------------------------------------------------------------------------------------- shared by the CP tests
def groups_for_tp(contexts: dict, tp: int, world: int) -> ParallelContext:
    """The TP x CP groups of ``world`` ranks with TP ``tp``, built once per TP size (kept in ``contexts``)."""
    if tp not in contexts:
        contexts[tp] = build_groups(tp, world // tp, 1, 1, torch.device("cpu"))
    return contexts[tp]


def results_of(worlds: dict, world: int, worker, *args) -> list[dict]:
    """``worker``'s results on ``world`` ranks, run once per world size (cached in ``worlds``)."""
    if world not in worlds:
        worlds[world] = run_distributed(worker, world, *args, timeout=300)
    return worlds[world]


def assert_close(got, want, what: str, rtol: float = 1e-5, atol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_model_matches(results: list[dict], name: str, reference) -> None:
    """Every rank's logits, loss, token losses and gradients of model case ``name`` equal ``reference``
    (:func:`run_model` in one process)."""
    ref_logits, ref_total, ref_losses, ref_grads = reference
    for rank, res in enumerate(results):
        logits, total, losses, grads = res[("model", name)]
        assert_close(logits, ref_logits, f"{name} rank {rank} logits")
        assert_close(total, ref_total, f"{name} rank {rank} loss", rtol=1e-6, atol=1e-6)
        assert_close(losses, ref_losses, f"{name} rank {rank} token losses")
        assert grads.keys() == ref_grads.keys()
        for key in ref_grads:
            assert_close(grads[key], ref_grads[key], f"{name} rank {rank} grad {key}", atol=1e-6)
