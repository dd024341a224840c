"""The mixture-of-experts MLP (routed experts, optional shared expert): ``MoELayer``'s numbers."""

from __future__ import annotations

from typing import Optional

from meshtron.config import ModelConfig, ffn_size
from meshtron.layer_kinds.base import (Counts, Matrix, MLPKind, RankParameters, SavedBytes, StepInputs, StepWork,
                                        mlp_matrices, mlp_saves, mlp_rank_parameters, mlp_weights)


class MixtureOfExperts(MLPKind):
    """``moe``: a router over --num-experts experts of width --moe-ffn-hidden-size (top --moe-router-topk per
    token), split over expert parallelism, and an optional shared expert. The Hugging Face names of experts
    and routers are architecture-specific patterns: :mod:`meshtron.checkpoint.hf` and
    :mod:`meshtron.checkpoint.hf_moe`."""

    name = "moe"
    module = "meshtron.layers.moe:MoELayer"
    has_experts = True

    def check(self, m: ModelConfig) -> Optional[str]:
        if not m.num_experts:
            return "moe layers need --num-experts"
        return None

    def build(self, cfg, ctx, index: int, prefix: str, sequence_parallel: bool):
        return self.module_class()(cfg, ctx, index, sequence_parallel, prefix=prefix)

    def parameters(self, m: ModelConfig) -> Counts:
        H, E, k = m.hidden_size, m.num_experts, m.moe_router_topk
        Fe = m.moe_ffn_hidden_size or ffn_size(m)
        expert_w = mlp_weights(m, Fe)
        expert_b = ((2 * Fe if m.swiglu else Fe) + H) if not m.disable_bias_linear else 0
        router = H * E
        Fs = m.moe_shared_expert_intermediate_size
        shared = mlp_weights(m, Fs) if Fs else 0
        return Counts(total=E * (expert_w + expert_b) + router + shared, matmul=k * expert_w + router + shared,
                      inactive=(E - k) * (expert_w + expert_b))

    def rank_parameters(self, m: ModelConfig, tp: int, ep: int, expert_tp: int) -> RankParameters:
        fe = m.moe_ffn_hidden_size or ffn_size(m)
        dense = float(m.hidden_size * m.num_experts)  # router (replicated)
        if m.moe_shared_expert_intermediate_size:
            dense += mlp_rank_parameters(m, m.moe_shared_expert_intermediate_size, tp)
        return RankParameters(dense=dense, expert=m.num_experts / ep * mlp_rank_parameters(m, fe, expert_tp))

    def matrices(self, m: ModelConfig) -> list[Matrix]:
        """The router, every routed expert's MLP (split over EP) and the shared expert's (replicated)."""
        fe = m.moe_ffn_hidden_size or ffn_size(m)
        out = [Matrix("router.weight", m.num_experts, m.hidden_size)]
        for i in range(m.num_experts):
            out += mlp_matrices(m, fe, f"experts.{i}.", expert=True)
        if m.moe_shared_expert_intermediate_size:
            out += mlp_matrices(m, m.moe_shared_expert_intermediate_size, "shared_experts.")
        return out

    def add_saved_bytes(self, m: ModelConfig, s: SavedBytes) -> None:
        e, h, etp = s.e, s.h, s.expert_tp
        fe = m.moe_ffn_hidden_size or ffn_size(m)
        k = m.moe_router_topk
        # The router reads the whole sequence on every TP rank: its fp32 input and logits/probabilities,
        # the routing indices (int64: top-k choices, the sort order, its source rows, the way back).
        s.part += 4 * h + 8 * m.num_experts + k * 38 + 8
        # The experts (eager, bf16), per choice: the rows of the aligned grouped-GEMM buffer (fc1's
        # input) and the output rows the weighted sum's batched matmul keeps; fc1's output, SiLU's
        # output and the SwiGLU product. fc2's output is not kept (the unpadding saves indices only).
        # Through the dispatcher (expert parallelism, a capacity) one more row per choice stays. Since
        # revision 3 of the saves, SwiGLU experts without an output bias on the direct path weigh each row
        # inside the activation (experts.forward_weighted): no output row, SiLU output or product stays, only
        # fc1's input row and output and each row's fp32 routing weight.
        weighted = s.local_experts and m.swiglu and m.disable_bias_linear and s.saves >= 3
        if weighted:
            s.part += k * (e * h + 4) + k * e * 2 * fe / etp
        elif m.swiglu and s.saves >= 4:
            # Since revision 4 the grouped SwiGLU experts recompute SwiGLU in the down projection's backward on
            # every path (weights 1 where the combine weighs): fc1's output and one fp32 weight per row. Since
            # revision 5 those without an output bias weigh the dispatched rows themselves: the combine keeps
            # no output row.
            rows = (2 if s.local_experts else 3) - (1 if s.saves >= 5 and m.disable_bias_linear else 0)
            if s.recompute == "selective":
                # Selective recomputation keeps the matmuls' outputs and makes the rest again: the down
                # projection's output rows stay (one per choice), not the grouped buffer (fc1's input) nor
                # what the dispatcher copies (DeepSeek-V3's EP=64 ranks, e28/e29 of benchmarks/emulated.jsonl).
                rows = 1
            s.part += k * e * rows * h + k * (4 + e * 2 * fe / etp)
        else:
            s.part += k * e * (2 if s.local_experts else 3) * h
            inner = (2 * fe + (0 if "act" in s.selective else 2 * fe) if m.swiglu
                     else fe + (0 if "act" in s.selective else fe))
            s.part += k * e * inner / etp
        if m.moe_shared_expert_intermediate_size:
            fs = m.moe_shared_expert_intermediate_size
            # its fc1's input (the normed tokens) and its MLP's saves as bf16 ones (not measured)
            s.part += s.lin * h + mlp_saves(m, s, fs, s.tp, False)

    def backward_working_bytes(self, m: ModelConfig, e: int, tp: int, expert_tp: int) -> float:
        per_width = 3 if m.swiglu else 2
        fe = m.moe_ffn_hidden_size or ffn_size(m)
        mlp = m.moe_router_topk * per_width * e * fe / expert_tp
        if m.moe_shared_expert_intermediate_size:
            mlp = max(mlp, per_width * e * m.moe_shared_expert_intermediate_size / tp)
        return mlp

    def fp8_weight_elements(self, m: ModelConfig, tp: int, fc2_recast: bool) -> float:
        # Before revision 2 (what this counts): the router, the routed experts and a shared expert's fc2 ran in
        # bf16, a shared expert's fc1 in FP8.
        fs = m.moe_shared_expert_intermediate_size or 0
        return m.hidden_size * (2 * fs if m.swiglu else fs) / tp

    def step_work(self, m: ModelConfig, x: StepInputs) -> StepWork:
        # Every TP rank routes, permutes and dispatches the whole sequence (meshtron.layers.moe.layer gathers the
        # sequence-parallel shards first): the permutation's copies and the all-to-all carry all of its tokens'
        # choices, never a TP share of them (the traces of the emulated DeepSeek-V3 and Mixtral ranks, TP=2).
        h, tokens, e, etp, gemm = m.hidden_size, x.tokens, x.e, x.expert_tp, x.gemm
        fe = m.moe_ffn_hidden_size or ffn_size(m)
        k, n_exp = m.moe_router_topk, m.num_experts
        local = n_exp / x.ep
        per_expert_tokens = tokens * x.ep * k / n_exp
        fan_in = 2 * fe if m.swiglu else fe
        # One grouped GEMM per projection runs every local expert in one kernel: its rate is that of
        # the whole product (all local experts' rows), not of one expert's.
        # With --fp8-experts the expert GEMMs run FP8 too (meshtron.layers.fp8.grouped).
        expert = (gemm(2 * local * per_expert_tokens * h * fan_in / etp, x.fp8_experts, experts=True)
                  + gemm(2 * local * per_expert_tokens * fe / etp * h, x.fp8_experts, experts=True))
        router = gemm(2 * tokens * h * n_exp)
        shared = 0.0
        fs = m.moe_shared_expert_intermediate_size
        if fs:
            shared = (gemm(2 * tokens * h * (2 * fs if m.swiglu else fs) / x.tp, x.fp8)
                      + gemm(2 * tokens * fs / x.tp * h, x.fp8))
        if (x.saves >= 3 and x.ep == 1 and m.moe_expert_capacity_factor is None and m.swiglu
                and m.disable_bias_linear and x.bf16):
            # experts.forward_weighted: the routing weight inside the fused SwiGLU (read gate and up, write the
            # product; backward recomputes it in the same pass), each token's rows gathered into the aligned
            # buffer and summed out of it (the slot-sum kernel): no permutation, unpadding or weighted combine.
            elementwise = tokens * e * (3 * k * fe / etp + 2 * k * h)
        else:
            elementwise = tokens * e * (3 * k * fe / etp + 8 * k * h)  # SwiGLU + permute copies
        elementwise += tokens * 3 * 4 * n_exp  # router softmax / top-k in fp32
        if fs:
            elementwise += tokens * e * 3 * fs / x.tp
        if x.fp8_experts:
            elementwise += fp8_expert_quantisation_bytes(tokens * k, h, fan_in / etp, fe / etp, local) / 3
        return StepWork(fwd_gemm=expert + router + shared, wgrad=expert + shared, elementwise=elementwise,
                        ep_bytes=tokens * k * h * e)


#: How many times its ideal traffic the FP8 experts' quantisation moves (per-group maxima through scatters,
#: index copies, transposed layouts), fitted to rows h170 and h172 (benchmarks/moe_side_by_side_one_gpu.yaml),
#: measured on an H100 and predicted, as every row of tests/planning/test_planner.py, with the H200 profile
#: (with the H100 profile's bandwidth 2.5 fits them as well).
FP8_EXPERT_QUANTISATION_PASSES = 3.5


def fp8_expert_quantisation_bytes(rows: float, h: int, fan_in: float, fe: float, local: float) -> float:
    """Bytes the FP8 experts' quantisations move in one micro-batch's forward and backward on one rank
    (meshtron.layers.fp8.grouped): every operand of the three grouped products read for its maximum, read again
    and written in e4m3 (5 bytes an element: the weights [local, fan_in, h] and [local, h, fe] in the forward and
    again transposed in the backward, the routed rows' activations and gradients), the weight gradient's two
    operands per group and column transposed (6), times :data:`FP8_EXPERT_QUANTISATION_PASSES`."""
    w1, w2 = local * fan_in * h, local * h * fe
    forward = 5 * (rows * h + w1 + rows * fe + w2)
    input_grads = 5 * (rows * h + w2 + rows * fan_in + w1)
    weight_grads = 6 * (2 * rows * h + rows * fe + rows * fan_in)
    return FP8_EXPERT_QUANTISATION_PASSES * (forward + input_grads + weight_grads)


MOE = MixtureOfExperts()
