"""What a transformer layer keeps for its backward: the values copied out of the fused QKV output and
SwiGLU's product recomputed by the down projection, with gradients unchanged, and the memory model's
per-layer count equal to the bytes the layer actually saves (eager and compiled)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.layers.linear import _SwiGLUMatmul, swiglu
from meshtron.memory import layer_activation_bytes
from meshtron.model import GPTModel
from meshtron.parallel.context import ParallelContext
from meshtron.parallel.sharding import initialize_parameters
from tests.checkpoint.ckpt_helpers import tiny_config
from tests.layers.saved_tensors import backward_matmuls, saved_storages

SEQ, BATCH = 16, 2


def test_swiglu_matmul_gradients_equal_autograd_of_the_plain_graph():
    torch.manual_seed(0)
    gate_up = torch.randn(5, 3, 2 * 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, 24, dtype=torch.float64, requires_grad=True)
    grad_out = torch.randn(5, 3, 8, dtype=torch.float64)
    expected = F.linear(swiglu(gate_up), weight)
    expected_grads = torch.autograd.grad(expected, (gate_up, weight), grad_out)
    got = _SwiGLUMatmul.apply(gate_up, weight)
    got_grads = torch.autograd.grad(got, (gate_up, weight), grad_out)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for g, e in zip(got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    torch.autograd.gradcheck(_SwiGLUMatmul.apply, (gate_up, weight))


def _layer(compiled: bool, **overrides):
    cfg = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      seq_length=SEQ, **overrides)
    model = GPTModel(cfg.model, ParallelContext(), 128, layer_ids=[0])
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    layer = model.layers["0"]
    if compiled:
        layer.compile()
    return cfg, model, layer


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_layer_keeps_neither_the_fused_qkv_output_nor_the_swiglu_product(compiled):
    """Compiled (the GPU default), the bytes a Llama-style layer saves for backward (fp32) equal the
    memory model's count exactly; eager, no saved tensor is the fused QKV output or SwiGLU's product."""
    cfg, model, layer = _layer(compiled)
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    rope = model._rope(SEQ, None, x.device, torch.float32)
    tables = {t.untyped_storage().data_ptr() for t in rope}  # the model's tables, shared by every layer
    for _ in range(2):  # the second call runs the compiled graphs
        out, storages = saved_storages(layer, x, rope, None, params=list(model.parameters()))
        matmuls = backward_matmuls(out)
    assert matmuls == 8  # four linears' input and weight gradients: fc2's recomputation runs no matmul
    per_token = {ptr: n // (SEQ * BATCH) for ptr, n in storages.items() if ptr not in tables}
    fp32 = 4
    assert (64 + 2 * 32) * fp32 not in per_token.values()  # QKV's output: q (4 heads) + k and v (2 groups of 16)
    assert 96 * fp32 not in per_token.values()  # SwiGLU's product (fc1's output, 2 x 96 wide, stays)
    assert 2 * 96 * fp32 in per_token.values()
    if compiled:
        expected = layer_activation_bytes(cfg.model, micro_batch=BATCH, seq=SEQ, act_bytes=fp32, compiled=True)
        legacy = layer_activation_bytes(cfg.model, micro_batch=BATCH, seq=SEQ, act_bytes=fp32, compiled=True,
                                        saves=0)
        assert sum(storages[p] for p in per_token) == expected
        assert legacy - expected == SEQ * BATCH * fp32 * (64 + 32 + 96)  # q and k of the QKV output, the product


def test_compiled_and_eager_layers_give_the_same_gradients():
    torch.manual_seed(0)
    x = torch.randn(SEQ, BATCH, 64)
    results = []
    for compiled in (False, True):
        _, model, layer = _layer(compiled)
        xin = x.clone().requires_grad_()
        out = layer(xin, model._rope(SEQ, None, x.device, torch.float32), None)
        out.square().sum().backward()
        results.append([xin.grad] + [p.grad for p in layer.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_swiglu_projection_recomputes_its_casts_with_identical_gradients(compiled):
    """FP8 (tensorwise) fc2: the product's and the weight's FP8 copies are recomputed in backward, not kept;
    output and gradients are bit-identical to the FP8 linear that keeps them."""
    from meshtron.layers.fp8 import fp8_linear
    from meshtron.layers.linear import _swiglu_fp8_recomputed

    torch.manual_seed(0)
    gate_up = torch.randn(32, 2, 2 * 96, requires_grad=True)
    weight = torch.randn(48, 96, requires_grad=True)
    grad_out = torch.randn(32, 2, 48)

    def kept(a, w, fmt):
        return fp8_linear(swiglu(a), w, None, fmt, "tensorwise")

    results = []
    for fn in (kept, _swiglu_fp8_recomputed):
        fn = torch.compile(fn) if compiled else fn
        for _ in range(2):
            out, storages = saved_storages(fn, gate_up, weight, "hybrid", params=[weight])
            grads = torch.autograd.grad(out, (gate_up, weight), grad_out)
        results.append((out, *grads, storages))
    (*expected, kept_storages), (*got, recomputed_storages) = results
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert list(recomputed_storages.values()) == [gate_up.untyped_storage().nbytes()]  # fc2's input only
    assert len(kept_storages) > 1  # the FP8 copies of the product and the weight, their scales


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fp8_layer_keeps_no_weight_copy(compiled):
    """FP8 (tensorwise) linears cast their weights again in backward: the layer saves no FP8 weight copy,
    and compiled it saves exactly what the memory model counts for FP8 (one-byte copies of the linears'
    inputs, nothing per weight)."""
    from meshtron.layers.linear import enable_fp8

    cfg, model, layer = _layer(False)
    enable_fp8(layer, "hybrid")
    if compiled:
        layer.compile()
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    rope = model._rope(SEQ, None, x.device, torch.float32)
    tables = {t.untyped_storage().data_ptr() for t in rope}
    params = list(model.parameters())
    fp8_shapes: set[tuple[int, ...]] = set()
    for _ in range(2):
        out, storages = saved_storages(layer, x, rope, None, params=params, fp8_shapes=fp8_shapes)
        matmuls = backward_matmuls(out, fp8=True)
    assert matmuls == 8  # no scaled matmul recomputed
    # Not counted by the model: the tables, and the FP8 scales (one fp32 element each).
    saved = {ptr: n for ptr, n in storages.items() if ptr not in tables and n > 4}
    weights = [p for p in layer.parameters() if p.dim() == 2]
    assert len(weights) == 4 and fp8_shapes  # QKV, output projection, fc1, fc2; the inputs' FP8 copies
    for w in weights:
        assert tuple(w.shape) not in fp8_shapes and tuple(w.shape[::-1]) not in fp8_shapes
    if compiled:
        expected = layer_activation_bytes(cfg.model, micro_batch=BATCH, seq=SEQ, act_bytes=4, compiled=True, fp8=True)
        assert sum(saved.values()) == expected


def test_compiled_rowwise_fp8_layer_saves_what_the_model_counts():
    """FP8 rowwise linears save their bf16 inputs; compiled, the norms' outputs among them and SwiGLU's
    product are recomputed in backward (no matmul): the layer keeps the memory model's rowwise count."""
    from meshtron.layers.linear import enable_fp8

    cfg, model, layer = _layer(False)
    enable_fp8(layer, "e4m3", "rowwise")
    layer.compile()
    x = torch.randn(SEQ, BATCH, 64, requires_grad=True)
    rope = model._rope(SEQ, None, x.device, torch.float32)
    tables = {t.untyped_storage().data_ptr() for t in rope}
    for _ in range(2):
        out, storages = saved_storages(layer, x, rope, None, params=list(model.parameters()))
        matmuls = backward_matmuls(out, fp8=True)
    assert matmuls == 8
    saved = sum(n for ptr, n in storages.items() if ptr not in tables)
    kwargs = dict(micro_batch=BATCH, seq=SEQ, act_bytes=4, compiled=True)
    assert saved == layer_activation_bytes(cfg.model, rowwise_fp8=True, **kwargs)
    assert layer_activation_bytes(cfg.model, **kwargs) - saved == SEQ * BATCH * 4 * 2 * 64  # the norms' outputs


def test_compiled_gated_deltanet_layer_saves_what_the_model_counts():
    """A gated DeltaNet layer (compiled, the GPU default) keeps exactly the bytes its kind counts: the chunked
    rule's [chunk, chunk] intermediates are recomputed in backward, not kept."""
    cfg = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=96,
                      seq_length=128, layer_pattern="gdn+dense", linear_num_key_heads=2, linear_num_value_heads=4,
                      linear_key_head_dim=16, linear_value_head_dim=8)
    model = GPTModel(cfg.model, ParallelContext(), 128, layer_ids=[0])
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    layer = model.layers["0"]
    layer.compile()
    x = torch.randn(128, BATCH, 64, requires_grad=True)
    rope = model._rope(128, None, x.device, torch.float32)
    tables = {t.untyped_storage().data_ptr() for t in rope}
    for _ in range(2):  # the second call runs the compiled graphs
        _, storages = saved_storages(layer, x, rope, None, params=list(model.parameters()))
    got = sum(n for ptr, n in storages.items() if ptr not in tables)
    assert got == layer_activation_bytes(cfg.model, micro_batch=BATCH, seq=128, act_bytes=4, compiled=True, layer=0)


def test_compiled_mla_layer_under_selective_recomputation_saves_what_the_model_counts():
    """Selective recomputation keeps an MLA layer's matmul outputs (the down, query and key/value projections',
    the output projection's, fc1's) and the attention kernel's output; the latent norms, the rotated queries and
    keys and the output projection's input are made again. Compiled (the GPU default), the layer keeps the
    model's count. The CPU runs MLA's attention (query/key and value head dims differ) through the math path,
    which keeps the s x s probabilities where flash attention keeps its log-sum-exp: compared without either."""
    seq = 40
    heads = 4
    mla = dict(multi_latent_attention=True, q_lora_rank=48, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8,
               v_head_dim=12, group_query_attention=False, num_query_groups=None)
    cfg = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=heads, ffn_hidden_size=96, seq_length=seq,
                      **mla)
    model = GPTModel(cfg.model, ParallelContext(), 128, layer_ids=[0], selective_recompute=True)
    initialize_parameters(model, 1, torch.device("cpu"), torch.float32)
    layer = model.layers["0"]
    layer.compile()
    rope = model._rope(seq, None, torch.device("cpu"), torch.float32)
    tables = {t.untyped_storage().data_ptr() for t in rope}
    for _ in range(2):  # the second call runs the compiled graphs
        x = torch.randn(seq, BATCH, 64, requires_grad=True)
        out, storages = saved_storages(layer, x, rope, None, params=list(model.parameters()))
        out.square().sum().backward()
    saved = [n for ptr, n in storages.items() if ptr not in tables]
    scores = BATCH * heads * seq * seq * 4
    assert saved.count(scores) == 1
    tokens = seq * BATCH
    kwargs = dict(micro_batch=BATCH, seq=seq, act_bytes=4, compiled=True, layer=0)
    expected = layer_activation_bytes(cfg.model, recompute="selective", **kwargs) - 4 * heads * tokens  # its lse
    assert sum(saved) - scores == expected
    # the model before: the normed latents (and their statistics), both rotated queries and keys, and the output
    # projection's input on top
    none = layer_activation_bytes(cfg.model, **kwargs)
    assert none > expected + tokens * 4 * (48 + 32 + 8 + 4 * 12)
