"""Multi-latent attention on CUDA: DeepSeek-V3's head dims (query/key 192, value 128) through the fused
attention kernels, and compiled TP=2 + SP layers over NCCL equal to one GPU. Needs CUDA (two devices for
the parallel case)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshtron.layers.sdpa import core_attention
from meshtron.parallel.context_parallel.kernels import MATH, select_kernel
from tests.layers.test_mla import YARN, mla_cfg

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _deepseek_qkv(dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 16, 1024, 192, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(1, 16, 1024, 192, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(1, 16, 1024, 128, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def test_a_fused_sdpa_kernel_takes_different_query_and_value_head_dims():
    """Which fused kernels accept (192, 128); at least one must, or MLA runs the math fallback."""
    q, k, v = _deepseek_qkv()
    accepted = []
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            accepted.append(backend.name)
        except RuntimeError:
            pass
    print("fused kernels accepting q/k 192, v 128:", accepted)
    assert set(accepted) & {"CUDNN_ATTENTION", "EFFICIENT_ATTENTION"}
    ref = core_attention(q.float(), k.float(), v.float(), None, 0.0, 0.1)
    torch.testing.assert_close(core_attention(q, k, v, None, 0.0, 0.1).float(), ref, rtol=2e-2, atol=2e-2)


def test_context_parallel_kernel_choice_for_mla_head_dims():
    q, _, v = _deepseek_qkv()
    assert select_kernel(q, False, v.shape[-1]) is MATH  # 192 > 128: the fp32 math kernel (slow)
    assert select_kernel(q[..., :128], False, 96).name == "cudnn"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (ranks share one GPU where there are fewer)")
def test_compiled_mla_tp2_sp_over_nccl_matches_one_gpu():
    from tests.parallel.test_compiled_parallel import compiled_layout_failures

    torch.backends.cuda.matmul.allow_tf32 = False
    cases = {"mla-tp2-sp": (mla_cfg(num_layers=2, seq_length=8, **YARN), dict(tp=2, sp=True), True)}
    failures = compiled_layout_failures("cuda", "nccl", rtol=1e-4, atol=1e-5, cases_by_name=cases)
    assert not failures, "\n".join(failures)
