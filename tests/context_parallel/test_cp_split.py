"""The load-balanced split, the block plans (balanced, covering exactly the causal pairs) and the
fp32 block kernel with its log-sum-exp (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshtron.config import ConfigError
from meshtron.parallel.context_parallel.attention import (Block, _merge, allgather_plan, check_comm_type, plan_pairs,
                                              ring_plan)
from meshtron.parallel.context_parallel.kernels import MATH, select_kernel
from meshtron.parallel.context_parallel.split import (SEQUENCE_KEYS, causal_pairs_per_rank, chunk_ids, local_token_indices,
                                        restore_sequence_order, split_micro_batch, split_sequence)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_split_and_restore_round_trip(cp):
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    parts = [split_sequence(x, cp, r, dim=1) for r in range(cp)]
    assert all(p.shape == (2, 24 // cp, 3) for p in parts)
    assert torch.equal(restore_sequence_order(parts, dim=1), x)
    for r, part in enumerate(parts):  # the local tokens are those local_token_indices names
        assert torch.equal(part[0, :, 0] // 3, local_token_indices(24 // cp, cp, r))


def test_rank_holds_chunk_r_and_its_mirror():
    assert [chunk_ids(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert local_token_indices(8, 4, 1).tolist() == [4, 5, 6, 7, 24, 25, 26, 27]  # S=32, chunks of 4


def test_split_micro_batch_splits_per_token_tensors_only():
    mb = {k: torch.arange(16).view(1, 16) for k in SEQUENCE_KEYS}
    mb["other"] = torch.arange(3)
    out = split_micro_batch(mb, 2, 1)
    for k in SEQUENCE_KEYS:
        assert out[k].tolist() == [[4, 5, 6, 7, 8, 9, 10, 11]]
    assert out["other"] is mb["other"]
    assert split_micro_batch(mb, 1, 0) is mb


def test_bad_sizes_name_the_flag():
    with pytest.raises(ConfigError, match="--context-parallel-size"):
        split_sequence(torch.zeros(1, 12), 4, 0)
    with pytest.raises(ConfigError, match="--cp-comm-type"):
        check_comm_type("ring")


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_causal_work_is_balanced(cp):
    seq = 16 * cp
    c = seq // (2 * cp)
    per_rank = causal_pairs_per_rank(seq, cp)
    assert len(set(per_rank)) == 1 and sum(per_rank) == seq * (seq + 1) // 2
    # a contiguous split would not be: the last rank's queries see far more keys
    contiguous = [sum(p + 1 for p in range(r * seq // cp, (r + 1) * seq // cp)) for r in range(cp)]
    assert contiguous[-1] > 2 * contiguous[0]
    for r in range(cp):
        ring = ring_plan(cp, r)
        assert len(ring) == cp and sorted(b.source for b in ring) == list(range(cp))
        assert plan_pairs(ring, c) == per_rank[r]
        assert plan_pairs(allgather_plan(cp, r), c) == per_rank[r]
        assert len({b.pairs(c) for b in ring if not b.causal}) <= 1  # every off-diagonal ring step costs the same


def _covered_pairs(plan: list[Block], cp: int, rank: int, c: int) -> list[tuple[int, int]]:
    """(query position, key position) pairs the blocks compute, by sequence index."""
    mine = local_token_indices(2 * c, cp, rank).tolist()
    pairs = []
    for b in plan:
        keys = (local_token_indices(2 * c, cp, b.source).tolist() if b.source is not None
                else list(range(2 * cp * c)))
        qs = mine[b.q_rows[0] * c:b.q_rows[1] * c]
        ks = keys[b.k_rows[0] * c:b.k_rows[1] * c]
        for i, q in enumerate(qs):
            for j, k in enumerate(ks):
                if not b.causal or j <= i:
                    pairs.append((q, k))
    return pairs


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("make_plan", [ring_plan, allgather_plan], ids=["ring", "allgather"])
def test_plans_cover_exactly_the_causal_pairs(cp, make_plan):
    c = 3
    for r in range(cp):
        pairs = _covered_pairs(make_plan(cp, r), cp, r, c)
        expected = {(q, k) for q in local_token_indices(2 * c, cp, r).tolist() for k in range(q + 1)}
        assert len(pairs) == len(set(pairs)) and set(pairs) == expected


# ----------------------------------------------------------------------------------------------- kernel
def _qkv(seed=0, b=2, heads=4, groups=2, sq=6, sk=6, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, sq, d, generator=g), torch.randn(b, groups, sk, d, generator=g),
            torch.randn(b, groups, sk, d, generator=g), torch.randn(b, heads, sq, d, generator=g))


def _reference(q, k, v, allowed):
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ kk.transpose(-1, -2)) / q.shape[-1] ** 0.5
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1).nan_to_num(0.0) @ vv, lse


@pytest.mark.parametrize("kind", ["full", "causal", "mask"])
def test_math_kernel_forward_backward(kind):
    q, k, v, dout = _qkv(sk=6 if kind != "full" else 9)
    scale = q.shape[-1] ** -0.5
    mask = None
    if kind == "mask":  # includes rows with no visible key (lse -inf, output 0)
        mask = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.5
        mask[:, :, 0] = False
    allowed = {"full": None, "causal": torch.ones(6, 6, dtype=torch.bool).tril(), "mask": mask}[kind]
    out, lse, state = MATH.forward(q, k, v, kind == "causal", mask, 0.0, scale)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = _reference(ref_q, ref_k, ref_v, allowed)
    torch.testing.assert_close(out, ref_out.detach())
    torch.testing.assert_close(lse, ref_lse.detach())
    ref_out.backward(dout)
    # rows with no visible key have lse -inf in this block; backward takes the whole row's (finite) lse
    finite_lse = lse.masked_fill(torch.isinf(lse), 0.0)
    grads = MATH.backward(dout, q, k, v, out, finite_lse, kind == "causal", mask, 0.0, scale, state)
    for got, want in zip(grads, (ref_q.grad, ref_k.grad, ref_v.grad)):
        torch.testing.assert_close(got, want)


def test_math_kernel_dropout_backward_matches_autograd():
    q, k, v, dout = _qkv(seed=2)
    scale, p = q.shape[-1] ** -0.5, 0.3
    torch.manual_seed(0)
    out, lse, seed = MATH.forward(q, k, v, True, None, p, scale)
    torch.manual_seed(0)
    again, _, _ = MATH.forward(q, k, v, True, None, p, scale)
    torch.testing.assert_close(out, again)  # the seed comes from the (tracked) generator
    keep = MATH._keep((2, 2, 2, 6, 6), p, seed, q.device).reshape(2, 4, 6, 6)
    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = 2
    s = (ref_q @ ref_k.repeat_interleave(rep, 1).transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    ref_out = (torch.softmax(s, -1) * keep) @ ref_v.repeat_interleave(rep, 1)
    torch.testing.assert_close(out, ref_out.detach())
    ref_out.backward(dout)
    grads = MATH.backward(dout, q, k, v, out, lse, True, None, p, scale, seed)
    for got, want in zip(grads, (ref_q.grad, ref_k.grad, ref_v.grad)):
        torch.testing.assert_close(got, want)


def test_blocks_merged_by_lse_equal_full_attention():
    q, k, v, _ = _qkv(sk=10)
    scale = q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"))
    for keys in (slice(0, 4), slice(4, 10)):
        o_b, l_b, _ = MATH.forward(q, k[:, :, keys], v[:, :, keys], False, None, 0.0, scale)
        _merge(out, lse, slice(0, 6), o_b, l_b)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    torch.testing.assert_close(out, ref)


def test_cpu_and_fp32_use_the_math_kernel():
    assert select_kernel(torch.zeros(1, 1, 2, 8), has_mask=False) is MATH
    assert select_kernel(torch.zeros(1, 1, 2, 8, dtype=torch.bfloat16), has_mask=True) is MATH


def test_a2a_flags_are_checked_in_one_line():
    from meshtron.cli import build_config
    from meshtron.cp_comm_types import a2a_kv_replicas
    from meshtron.validation import validate_config

    base = ["--device", "cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
            "--group-query-attention", "--num-query-groups", "2", "--seq-length", "64", "--global-batch-size", "4"]
    cfg = build_config(base + ["--context-parallel-size", "4", "--cp-comm-type", "a2a", "a2a", "a2a"])
    assert validate_config(cfg, 4).parallel.cp_comm_type == "a2a"
    assert a2a_kv_replicas(8, 2, 4) == 2 and a2a_kv_replicas(8, 8, 4) == 1
    with pytest.raises(ConfigError, match="one type for every layer") as err:
        build_config(base + ["--cp-comm-type", "a2a", "p2p"])
    assert "\n" not in str(err.value)
    for flags, world, message in [
        (["--context-parallel-size", "8", "--seq-length", "64", "--cp-comm-type", "a2a", "--tensor-model-parallel-size",
          "2"], 16, r"--cp-comm-type a2a needs the attention heads per tensor-parallel rank \(8 / "
                    r"--tensor-model-parallel-size 2\) \(4, key/value heads 1\) divisible by --context-parallel-size"),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"], 4, "--hierarchical-context-parallel-sizes A B"),
        (["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "3",
          "2"], 4, "A x B = --context-parallel-size"),
        (["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"], 4, "a2a\\+p2p, not p2p"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            validate_config(build_config(base + flags), world)
        assert "\n" not in str(err.value)
