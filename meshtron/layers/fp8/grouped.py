"""FP8 expert GEMMs of the MoE layers: each local expert's projection of its own rows, with scaled e4m3 operands.

The experts compute on one buffer of rows grouped by local expert (:func:`meshtron.layers.moe.experts.aligned_layout`;
in FP8 every group starts on a multiple of :data:`GROUP_ALIGN` = 16 rows and holds at least 16, zero rows where the
expert has fewer). A projection ``y_r = x_r W_e^T`` of the rows r of expert e, with the experts' weights stacked
as ``w`` [E, N, K], has three products:

- forward ``y [M, N] = x [M, K] @ W_e^T``, contracting K;
- input gradient ``dx [M, K] = g [M, N] @ W_e``, contracting N;
- weight gradient ``dW_e [N, K] = g_e^T @ x_e``, contracting the expert's own rows.

Scales (each maps its slice's current absolute maximum onto e4m3's largest value, 448 / amax; e4m3 throughout):

- ``tensorwise``: one scale per expert for each operand: its rows of the input (or of the output gradient) and its
  weight. The same FP8 values serve all three products. Per expert rather than per buffer, so that an expert's
  scale does not depend on which other experts share the rank (expert parallelism) nor on another expert's outliers.
- ``rowwise``: one scale per row along the dimension that is not contracted: forward, the input per row and
  ``W_e`` per output feature; input gradient, the output gradient per row and ``W_e`` per input feature; weight
  gradient, the output gradient and the input per feature over the expert's rows (one scale per expert and
  feature).
- ``blockwise`` (DeepSeek-V3's, as :mod:`meshtron.layers.fp8.blockwise` for dense linears): the input and the
  output gradient in 1 x 128 tiles along the contracted dimension, each ``W_e`` in 128 x 128 blocks (its own
  blocks, serving both orientations); the weight gradient tiles the output gradient and the input along the
  expert's rows (one scale per feature for every 128 rows, counted from the group's first row).

Kernels. On CUDA the tensorwise and rowwise products run as one ``torch._scaled_grouped_mm`` each (Hopper, sm90):
its only scaling is one fp32 scale per row of the first operand and one per column of the second, for each group,
so a tensorwise scale is broadcast to those vectors. Its other terms: e4m3 operands, bf16 output, the first
operand row-major and the second column-major (the weight's transposed view, or a transposed FP8 copy), every
matrix dimension a multiple of 16, group offsets int32 on the device (no host synchronisation), group starts
along a contracted row dimension on 16-byte boundaries and no empty group in the weight gradient (hence the
16-row groups of at least 16 rows). Torch has no grouped kernel with blockwise scales: blockwise runs a loop over
the local experts of the blockwise scaled matmul of dense linears (:func:`meshtron.layers.fp8.blockwise.blockwise_mm`,
cuBLASLt), which needs the group offsets on the host: one device-to-host copy per MoE layer and forward, kept for
the backward. Elsewhere (CPU) the same quantised operands are multiplied per expert: the fp32 product of the e4m3
values times the scales, which is what the kernels compute up to the order of accumulation; the CPU tests check it.

The forward product accumulates in the tensor cores' fast mode (tensorwise and rowwise), the gradients in full fp32,
as the dense linears do. Output gradients are e4m3 under ``--fp8-format hybrid`` too: the grouped kernel takes e4m3
operands only. What the experts keep for backward is what the bf16 experts keep (each projection's bf16 input);
every operand is quantised again in backward, the weight included (the same values as the forward's).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from meshtron.layers.fp8.blockwise import TILE, _pad_to_tiles, blockwise_mm, quantize_tiles
from meshtron.layers.fp8.cast import scaled_cast
from meshtron.layers.fp8.operands import output_dtype
from meshtron.layers.fp8.recipes import E4M3, quantize_rows, scale_from_amax
from meshtron.layers.fused import compiled_on_cuda

RECIPES = ("tensorwise", "rowwise", "blockwise")

#: Rows per group boundary (and fewest rows of a group) in the FP8 experts' buffer: 16 one-byte rows keep every
#: group's start 16-byte aligned along the weight gradient's contraction, and no group empty.
GROUP_ALIGN = 16


class ExpertGroups:
    """The row groups of an experts' buffer: ``offs`` (int32 [G]: each group's end, on the buffer's device) and
    ``expert_of_row`` ([M]: each row's group). :meth:`bounds` copies the offsets to the host, once."""

    def __init__(self, offs: torch.Tensor, expert_of_row: torch.Tensor):
        self.offs, self.expert_of_row = offs, expert_of_row
        self._bounds: Optional[list[tuple[int, int]]] = None

    @property
    def num_groups(self) -> int:
        return self.offs.numel()

    def bounds(self) -> list[tuple[int, int]]:
        """(first row, end) of each group: a device-to-host copy of the offsets on CUDA, the first time only."""
        if self._bounds is None:
            ends = self.offs.tolist()
            self._bounds = list(zip([0] + ends[:-1], ends))
        return self._bounds


def group_amax(x: torch.Tensor, expert_of_row: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The largest absolute value of each group's rows of ``x`` (``expert_of_row``: each row's group): [G] for
    ``x`` [M], [G, C] (per column) for ``x`` [M, C]. fp32, no gradient."""
    x = x.detach().abs()
    index = expert_of_row
    if x.shape[0] % GROUP_ALIGN == 0 and x.shape[0]:
        # Rows in chunks of 16 never cross a group's boundary: their maximum first, then 16 times fewer updates.
        x = x.reshape(x.shape[0] // GROUP_ALIGN, GROUP_ALIGN, *x.shape[1:]).amax(dim=1)
        index = index[::GROUP_ALIGN]
    out = torch.zeros((num_groups,) + tuple(x.shape[1:]), dtype=torch.float32, device=x.device)
    if x.dim() == 2:
        index = index[:, None].expand(x.shape)  # a view
    return out.scatter_reduce_(0, index, x.float(), "amax")


def quantize_per_group(x: torch.Tensor, expert_of_row: torch.Tensor, num_groups: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [M, C] as e4m3 with one scale per group of rows, 1/scale [G])."""
    scale, inv = scale_from_amax(group_amax(x.detach().abs().amax(dim=1), expert_of_row, num_groups), E4M3)
    return scaled_cast(x, scale[expert_of_row][:, None], E4M3), inv


def quantize_per_expert(w: torch.Tensor, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(``w`` [E, N, K] as e4m3 with one scale per expert, 1/scale [E]); ``transposed``: the values as a
    contiguous [E, K, N] (the input gradient's column-major second operand, seen transposed)."""
    scale, inv = scale_from_amax(w.detach().abs().amax(dim=(1, 2)), E4M3)
    q = scaled_cast(w.transpose(1, 2) if transposed else w, scale[:, None, None], E4M3)
    return q.contiguous(), inv


def quantize_stacked_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``w`` [E, R, C] as e4m3, 1/scale [E, ceil(R / 128), ceil(C / 128)]): each expert's 128 x 128 blocks."""
    experts, rows, cols = w.shape
    padded = _pad_to_tiles(w, (1, 2))
    blocks = padded.view(experts, padded.shape[1] // TILE, TILE, padded.shape[2] // TILE, TILE)
    scale, inv = scale_from_amax(blocks.detach().abs().amax(dim=(2, 4), keepdim=True), E4M3)
    q = scaled_cast(blocks, scale, E4M3).view(padded.shape)[:, :rows, :cols]
    return q, inv[:, :, 0, :, 0]


def _quantize_rows_per_group(x: torch.Tensor, expert_of_row: torch.Tensor, num_groups: int
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [M, C] as e4m3, transposed and contiguous [C, M], 1/scale [G, C]): one scale per group and column,
    constant along the rows (the weight gradient's contraction)."""
    scale, inv = scale_from_amax(group_amax(x, expert_of_row, num_groups), E4M3)
    return scaled_cast(x, scale[expert_of_row], E4M3).t().contiguous(), inv


def _transposed_per_group(x: torch.Tensor, expert_of_row: torch.Tensor, num_groups: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x`` [M, C] as e4m3 with one scale per group, transposed and contiguous [C, M], 1/scale [G])."""
    q, inv = quantize_per_group(x, expert_of_row, num_groups)
    return q.t().contiguous(), inv


def _quantize_transposed_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``w`` [E, N, K] as a contiguous e4m3 [E, K, N] with one scale per input feature, 1/scale [E, K, 1])."""
    q, inv = quantize_rows(w.transpose(1, 2), 2)
    return q.contiguous(), inv


# On CUDA every quantisation runs compiled: its absolute maximum as one reduction, then the scale, saturation
# and cast (and a transposed layout) in one pass; eagerly each step of it is a pass of its own over tensors as
# large as all the experts' weights (a step of the Qwen3-30B-A3B layer shape took 2.3x bf16's that way). Row
# counts change every step: automatic dynamic shapes (one recompilation with the rows symbolic).
_rows_q = compiled_on_cuda(quantize_rows, dynamic=None)
_transposed_rows_q = compiled_on_cuda(_quantize_transposed_rows, dynamic=None)
_group_q = compiled_on_cuda(quantize_per_group, dynamic=None)
_expert_q = compiled_on_cuda(quantize_per_expert, dynamic=None)
_group_rows_q_t = compiled_on_cuda(_quantize_rows_per_group, dynamic=None)
_group_q_t = compiled_on_cuda(_transposed_per_group, dynamic=None)
_blocks_q = compiled_on_cuda(quantize_stacked_blocks, dynamic=None)
_tiles_q = compiled_on_cuda(quantize_tiles, dynamic=None)


def grouped_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      groups: ExpertGroups, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """The grouped product of e4m3 operands with inverse scales, as ``torch._scaled_grouped_mm`` takes them:

    - ``b`` 3-D: ``a`` [M, K] (rows grouped), ``b`` [G, K, N] (column-major), ``scale_a`` [M] (one per row),
      ``scale_b`` [G, N] (one per column of each group's matrix) -> [M, N];
    - ``b`` 2-D: ``a`` [N, M] and ``b`` [M, K] (column-major) both split along M, ``scale_a`` [G * N] and
      ``scale_b`` [G * K] (one per row of ``a`` / column of ``b`` for each group) -> [G, N, K].

    The kernel on CUDA; elsewhere the fp32 product of each group's e4m3 values times its scales."""
    if a.is_cuda:
        return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=groups.offs, out_dtype=out_dtype,
                                        use_fast_accum=fast_accum)
    bounds = groups.bounds()
    if b.dim() == 3:
        out = torch.zeros(a.shape[0], b.shape[2], dtype=torch.float32, device=a.device)
        for e, (s, t) in enumerate(bounds):
            out[s:t] = (a[s:t].float() @ b[e].float()) * scale_a[s:t, None] * scale_b[e][None, :]
        return out.to(out_dtype)
    n, k = a.shape[0], b.shape[1]
    sa, sb = scale_a.view(len(bounds), n), scale_b.view(len(bounds), k)
    out = torch.zeros(len(bounds), n, k, dtype=torch.float32, device=a.device)
    for e, (s, t) in enumerate(bounds):
        out[e] = (a[:, s:t].float() @ b[s:t].float()) * sa[e][:, None] * sb[e][None, :]
    return out.to(out_dtype)


def _per_group_rows(groups: ExpertGroups, shape: tuple[int, int], like: torch.Tensor, out_dtype: torch.dtype,
                    product: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    """[M, N] whose rows of group e are ``product(e, first, end)`` (zeros where a group has no rows)."""
    out = like.new_zeros(shape, dtype=out_dtype)
    for e, (s, t) in enumerate(groups.bounds()):
        if t > s:
            out[s:t] = product(e, s, t)
    return out


def forward_product(x: torch.Tensor, w: torch.Tensor, groups: ExpertGroups, recipe: str) -> torch.Tensor:
    """``y [M, N]``: each row of ``x`` [M, K] times its expert's ``W_e^T`` (``w`` [E, N, K]), in FP8."""
    out = output_dtype(x.dtype)
    experts, n, _ = w.shape
    if recipe == "blockwise":
        xq, x_inv = _tiles_q(x)                          # per row, along K
        wq, w_inv = _blocks_q(w)
        return _per_group_rows(groups, (x.shape[0], n), x, out,
                               lambda e, s, t: blockwise_mm(xq[s:t], x_inv[s:t], wq[e], w_inv[e], True, out))
    if recipe == "rowwise":
        xq, x_inv = _rows_q(x, 1)                        # [M, 1]: per row
        wq, w_inv = _rows_q(w, 2)                        # [E, N, 1]: per output feature
        sa, sb = x_inv.view(-1), w_inv.view(experts, n)
    else:
        xq, x_inv = _group_q(x, groups.expert_of_row, groups.num_groups)
        wq, w_inv = _expert_q(w)
        sa, sb = x_inv[groups.expert_of_row], w_inv[:, None].expand(experts, n).contiguous()
    return grouped_scaled_mm(xq, wq.transpose(1, 2), sa, sb, groups, out, fast_accum=True)


def input_grad_product(g: torch.Tensor, w: torch.Tensor, groups: ExpertGroups, recipe: str) -> torch.Tensor:
    """``dx [M, K]``: each row of ``g`` [M, N] times its expert's ``W_e`` (``w`` [E, N, K]), in FP8."""
    out = output_dtype(g.dtype)
    experts, _, k = w.shape
    if recipe == "blockwise":
        gq, g_inv = _tiles_q(g)                          # per row, along N
        wq, w_inv = _blocks_q(w)                         # the forward's blocks, read transposed
        return _per_group_rows(groups, (g.shape[0], k), g, out,
                               lambda e, s, t: blockwise_mm(gq[s:t], g_inv[s:t], wq[e].t(), w_inv[e].t(), True, out))
    if recipe == "rowwise":
        gq, g_inv = _rows_q(g, 1)                        # per row
        wq_t, w_inv = _transposed_rows_q(w)              # [E, K, N], one scale per input feature
        sa, sb = g_inv.view(-1), w_inv.view(experts, k)
    else:
        gq, g_inv = _group_q(g, groups.expert_of_row, groups.num_groups)
        wq_t, w_inv = _expert_q(w, True)
        sa, sb = g_inv[groups.expert_of_row], w_inv[:, None].expand(experts, k).contiguous()
    return grouped_scaled_mm(gq, wq_t.transpose(1, 2), sa, sb, groups, out)


def weight_grad_product(g: torch.Tensor, x: torch.Tensor, groups: ExpertGroups, recipe: str) -> torch.Tensor:
    """``dW [E, N, K]``: for each expert, its rows of ``g`` [M, N] transposed times its rows of ``x`` [M, K], in FP8
    (in ``x``'s dtype, bf16 on GPU: the weight's own layout, as the kernel writes it)."""
    out = output_dtype(x.dtype)
    n, k = g.shape[1], x.shape[1]
    if recipe == "blockwise":
        dw = x.new_zeros((groups.num_groups, n, k), dtype=out)
        for e, (s, t) in enumerate(groups.bounds()):
            if t > s:  # tiles along the expert's rows, from its first row
                gtq, gt_inv = _tiles_q(g[s:t].t())
                xtq, xt_inv = _tiles_q(x[s:t].t())
                dw[e] = blockwise_mm(gtq, gt_inv, xtq, xt_inv, False, out)
        return dw
    if recipe == "rowwise":
        gq_t, g_inv = _group_rows_q_t(g, groups.expert_of_row, groups.num_groups)  # [N, M]: per expert, feature
        xq_t, x_inv = _group_rows_q_t(x, groups.expert_of_row, groups.num_groups)  # [K, M]
        sa, sb = g_inv.reshape(-1), x_inv.reshape(-1)
    else:
        gq_t, g_inv = _group_q_t(g, groups.expert_of_row, groups.num_groups)
        xq_t, x_inv = _group_q_t(x, groups.expert_of_row, groups.num_groups)
        sa = g_inv[:, None].expand(-1, n).reshape(-1)
        sb = x_inv[:, None].expand(-1, k).reshape(-1)
    return grouped_scaled_mm(gq_t, xq_t.t(), sa, sb, groups, out)


class GroupedFP8Products:
    """The three FP8 products of one recipe over the groups of one buffer (what
    :class:`meshtron.layers.moe.experts._WeightedSwiGLUDown` and :class:`_FP8GroupedLinear` call)."""

    def __init__(self, groups: ExpertGroups, recipe: str):
        if recipe not in RECIPES:
            raise ValueError(f"FP8 experts take recipe {', '.join(RECIPES)}, not {recipe!r}")
        self.groups, self.recipe = groups, recipe

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return forward_product(x, w, self.groups, self.recipe)

    def input_grad(self, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return input_grad_product(g.contiguous(), w, self.groups, self.recipe)

    def weight_grad(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return weight_grad_product(g.contiguous(), x, self.groups, self.recipe)


class _FP8GroupedLinear(torch.autograd.Function):
    """``y_r = x_r W_{e(r)}^T`` over the buffer's groups, the three products in FP8; saves ``x`` (bf16)."""

    @staticmethod
    def forward(ctx, x, w, products):
        ctx.save_for_backward(x, w)
        ctx.products = products
        return products.forward(x, w)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad_x = ctx.products.input_grad(grad, w) if ctx.needs_input_grad[0] else None
        grad_w = ctx.products.weight_grad(grad, x).to(w.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w, None


def fp8_grouped_linear(x: torch.Tensor, w: torch.Tensor, products: GroupedFP8Products) -> torch.Tensor:
    """Each row of ``x`` [M, K] (an aligned buffer of :class:`ExpertGroups`) times its expert's ``W_e^T``, ``w``
    [E, N, K]: forward, input and weight gradients in FP8 (``products``: the recipe and groups)."""
    return _FP8GroupedLinear.apply(x, w, products)


def grouped_support_error(hidden: int, expert_width: int, recipe: str) -> Optional[str]:
    """Why the FP8 experts (``hidden`` x ``expert_width`` per tensor-parallel rank) cannot run on this machine's GPU
    with ``recipe``, or None where they can (or where there is no GPU to ask)."""
    if recipe == "blockwise":
        return None  # the dense blockwise matmul, per expert (its own check covers it)
    if not hasattr(torch, "_scaled_grouped_mm"):
        return (f"--fp8-recipe {recipe} with MoE experts needs torch._scaled_grouped_mm, which this torch "
                f"({torch.__version__}) lacks")
    if hidden % 16 or expert_width % 16:
        return (f"--fp8-recipe {recipe} with MoE experts needs the hidden size ({hidden}) and each expert's width per "
                f"tensor-parallel rank ({expert_width}) to be multiples of 16 (torch._scaled_grouped_mm)")
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) not in ((9, 0), (10, 0)):  # the devices torch._scaled_grouped_mm itself admits
        return (f"--fp8-recipe {recipe} with MoE experts needs a GPU of compute capability 9.0 or 10.0 (torch's "
                f"grouped FP8 kernel); this one is {major}.{minor}")
    return None
