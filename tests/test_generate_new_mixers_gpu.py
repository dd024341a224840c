"""The newer token mixers' decode states on CUDA: a sink-attention model prefills through compiled flex attention
(heads of 16 or more; SDPA below) and decodes through SDPA over its (windowed) cache, a gated DeltaNet model
prefills through the chunked rule and decodes one recurrent step at a time; both must give the whole sequence's
logits. Needs CUDA."""

from __future__ import annotations

import pytest
import torch

from tests.layers.test_new_layers_gpu import _full_fp32  # noqa: F401 (an autouse fixture: plain fp32 matmuls)
from tests.test_generate_new_mixers import MODELS, _model, gpt_oss_like, incremental_logits


def gpt_oss_flex():
    """The gpt-oss-like model with heads of 16, which flex attention's compiled kernel takes (heads of 8 run SDPA)."""
    m = gpt_oss_like()
    m.kv_channels = 16
    return m


CASES = {**MODELS, "gpt_oss_flex": gpt_oss_flex}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", CASES)
def test_cuda_prefill_then_one_token_steps_equal_the_whole_sequence(name):
    model = _model(CASES[name]).cuda()
    tokens = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        want = model(tokens=tokens)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(incremental_logits(model, tokens, 7), want, rtol=1e-4, atol=1e-4)
