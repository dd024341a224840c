"""Gated DeltaNet: the chunked recurrence equals the token loop, the layer equals Qwen3.5's
(TP=2: tests/layers/test_new_layers_tp.py; context parallelism: tests/context_parallel/test_cp_gated_deltanet.py)."""

from __future__ import annotations

import pytest
import torch

from meshtron.layers.documents import DocumentMask
from meshtron.layers.gated_deltanet import (CHUNK, GatedDeltaNet, chunk_gated_delta_rule, chunk_rule_keeping_inputs,
                                            document_segments, gated_delta_rule, gated_delta_rule_reference)
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import gather_canonical, initialize_parameters
from tests.layers.canonical import close, load_canonical

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(b=2, s=150, h=3, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=g), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(b, s, h, dk, generator=g), dim=-1)
    v = torch.randn(b, s, h, dv, generator=g)
    # decays from almost none to strong (exp(-3)), enough to underflow products over a chunk
    decay = -torch.rand(b, s, h, generator=g) * 3
    beta = torch.rand(b, s, h, generator=g)
    state = torch.randn(b, h, dk, dv, generator=g) * 0.1
    return [t.requires_grad_() for t in (q, k, v, decay, beta, state)]


@pytest.mark.parametrize("s", [150, 64, 5])
def test_chunked_equals_token_loop_forward_and_gradients(s):
    ref_in = _inputs(s=s)
    got_in = [t.detach().clone().requires_grad_() for t in ref_in]
    ref_out, ref_state = gated_delta_rule_reference(*ref_in[:5], initial_state=ref_in[5])
    got_out, got_state = chunk_gated_delta_rule(*got_in[:5], initial_state=got_in[5])
    torch.testing.assert_close(got_out, ref_out, **TOL)
    torch.testing.assert_close(got_state, ref_state, **TOL)
    w = torch.randn_like(ref_out)
    ws = torch.randn_like(ref_state)
    ((ref_out * w).sum() + (ref_state * ws).sum()).backward()
    ((got_out * w).sum() + (got_state * ws).sum()).backward()
    for name, a, b in zip("q k v g beta state".split(), got_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")


def test_training_path_keeps_only_the_rules_inputs_and_gives_the_same_gradients():
    """Under autograd the ``chunk`` kernel keeps its inputs only (no [chunk, chunk] tensor) and recomputes the
    chunks in backward, with the plain chunked rule's outputs and gradients bit for bit."""
    segments = document_segments(torch.tensor(DOCS))
    plain_in = _inputs(s=150)
    kept_in = [t.detach().clone().requires_grad_() for t in plain_in]
    plain = chunk_gated_delta_rule(*plain_in[:5], initial_state=plain_in[5], segments=segments)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        kept = gated_delta_rule(*kept_in[:5], kernel="chunk", initial_state=kept_in[5], segments=segments)
    assert not any(len(sh) >= 2 and sh[-2:] == (CHUNK, CHUNK) for sh in shapes), shapes
    assert len(shapes) <= 7, shapes  # q, k, v, g, beta, the initial state, the segments
    w, ws = torch.randn_like(plain[0]), torch.randn_like(plain[1])
    for (out, state), inputs in ((plain, plain_in), (kept, kept_in)):
        ((out * w).sum() + (state * ws).sum()).backward()
    assert torch.equal(kept[0], plain[0]) and torch.equal(kept[1], plain[1])
    for name, a, b in zip("q k v g beta state".split(), kept_in, plain_in):
        assert torch.equal(a.grad, b.grad), name
    assert chunk_rule_keeping_inputs is not chunk_gated_delta_rule


# document runs: starts inside a chunk, exactly on a chunk boundary (64), one run over a whole chunk,
# one-token documents, an id met again after another document
DOCS = [0] * 10 + [1] * 54 + [2] * 70 + [3] + [4] * 5 + [1] * 10, [7] * 64 + [8] * 1 + [9] * 85


def test_chunked_equals_token_loop_with_packed_documents():
    ref_in = _inputs(s=150)
    got_in = [t.detach().clone().requires_grad_() for t in ref_in]
    segments = document_segments(torch.tensor(DOCS))
    ref_out, ref_state = gated_delta_rule_reference(*ref_in[:5], initial_state=ref_in[5], segments=segments)
    got_out, got_state = chunk_gated_delta_rule(*got_in[:5], initial_state=got_in[5], segments=segments)
    torch.testing.assert_close(got_out, ref_out, **TOL)
    torch.testing.assert_close(got_state, ref_state, **TOL)
    w, ws = torch.randn_like(ref_out), torch.randn_like(ref_state)
    ((ref_out * w).sum() + (ref_state * ws).sum()).backward()
    ((got_out * w).sum() + (got_state * ws).sum()).backward()
    for name, a, b in zip("q k v g beta state".split(), got_in, ref_in):
        torch.testing.assert_close(a.grad, b.grad, **TOL, msg=lambda m: f"grad of {name}: {m}")


def test_packed_documents_equal_each_document_alone():
    """The layer over packed documents gives each document what it gives that document alone (the
    convolution's window and the state restart at every document)."""
    layer = _layer(ParallelContext())
    initialize_parameters(layer, 3, torch.device("cpu"), torch.float32)
    docs = torch.tensor(DOCS)
    x = torch.randn(150, 2, 32)
    packed = layer(x, mask=DocumentMask.causal(docs))
    segments = document_segments(docs)
    for row in range(2):
        for seg in segments[row].unique():
            where = (segments[row] == seg).nonzero()[:, 0]
            alone = layer(x[where, row:row + 1])
            close(packed[where, row:row + 1], alone, f"row {row}, run {seg.item()}")


def _layer(ctx, kernel="chunk", sp=False):
    return GatedDeltaNet(ctx, "layers.0.mixer", hidden_size=32, num_key_heads=2, num_value_heads=4,
                         key_head_dim=8, value_head_dim=6, conv_kernel_size=4, norm_eps=1e-6,
                         sequence_parallel=sp, kernel=kernel)


def test_matches_transformers_qwen3_5_gated_deltanet():
    pytest.importorskip("transformers")
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(hidden_size=32, num_hidden_layers=1, layer_types=["linear_attention"],
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                            linear_value_head_dim=6, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=64)
    hf = Qwen3_5GatedDeltaNet(cfg, 0).float()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if name != "norm.weight" else 0.1) + (1 if name == "norm.weight" else 0))
    ours = _layer(ParallelContext())
    load_canonical(ours, {f"layers.0.mixer.{n}": (p.squeeze(1) if n == "conv1d.weight" else p).detach()
                          for n, p in hf.named_parameters()})
    x = torch.randn(2, 70, 32)  # two chunks, the second padded
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    y_hf = hf(x_hf)
    y_ours = ours(x_ours)
    torch.testing.assert_close(y_ours.transpose(0, 1), y_hf, **TOL)
    w = torch.randn_like(y_hf)
    (y_hf * w).sum().backward()
    (y_ours * w.transpose(0, 1)).sum().backward()
    close(x_ours.grad.transpose(0, 1), x_hf.grad, "input gradient")
    grads = gather_canonical([ours], "grad")
    for n, p in hf.named_parameters():
        close(grads[f"layers.0.mixer.{n}"], p.grad.squeeze(1) if n == "conv1d.weight" else p.grad, n)


def test_refuses_what_it_does_not_support():
    assert GatedDeltaNet.supports_context_parallel is True  # tests/context_parallel/test_cp_gated_deltanet.py
    layer = _layer(ParallelContext())
    with pytest.raises(NotImplementedError):
        layer(torch.zeros(4, 1, 32, device="meta"), mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    with pytest.raises(NotImplementedError):  # a decode state: one sequence, no packed documents
        layer(torch.zeros(4, 1, 32, device="meta"), mask=torch.ones(1, 1, 4, 4, dtype=torch.bool), cache=object())


def test_the_kinds_chunk_is_the_layers():
    """The step-time model counts the chunked rule's loop with the layer's own chunk size."""
    from meshtron.layer_kinds import gated_deltanet as kind

    assert kind.CHUNK == CHUNK
