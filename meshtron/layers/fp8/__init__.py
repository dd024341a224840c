"""FP8 training: scaled matmuls with current scaling, in one package.

- :mod:`meshtron.layers.fp8.recipes`: the tensorwise and rowwise FP8 linears and their scales (the switch of a
  model's tensor-parallel linears to FP8, :func:`meshtron.layers.linear.enable_fp8`, lives beside those linears);
- :mod:`meshtron.layers.fp8.blockwise`: the blockwise recipe (DeepSeek-V3's 1x128 tiles and 128x128 blocks),
  with a CPU emulation of the scaled matmul;
- :mod:`meshtron.layers.fp8.operands`: what every recipe's linear shares (output dtype, weight-gradient deferral);
- :mod:`meshtron.layers.fp8.cast`: the FP8 cast with its transposed copy in one pass (a Triton kernel on CUDA);
- :mod:`meshtron.layers.fp8.sequence_parallel`: the tensor-parallel linears under sequence parallelism,
  cast before their collectives so that the all-gathers move one byte per element.
"""

from meshtron.layers.fp8.recipes import (E4M3, E5M2, cast_both_layouts, cast_weight, fp8_linear,
                                         gradient_dtype, output_dtype, recast_weight, scale_from_amax, scaled_mm,
                                         tensor_amax, tensor_scale, weight_grad_now_or_deferred)

__all__ = ["E4M3", "E5M2", "cast_both_layouts", "cast_weight", "fp8_linear", "gradient_dtype",
           "output_dtype", "recast_weight", "scale_from_amax", "scaled_mm", "tensor_amax", "tensor_scale",
           "weight_grad_now_or_deferred"]
