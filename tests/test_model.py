"""Model-level pieces that the lossless tests cannot see on tiny vocabularies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model.llama import _LM_HEAD_SLICE, lm_head


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 64, 130])
@pytest.mark.parametrize("hidden", [96, 576])
def test_sliced_lm_head_is_bit_identical(dtype, rows, hidden):
    """The float32 CPU LM head runs over vocabulary slices; every logit must equal F.linear's
    exactly (a vocabulary that is not a multiple of the slice included; SmolLM2's hidden size)."""
    g = torch.Generator().manual_seed(rows)
    vocab = 3 * _LM_HEAD_SLICE + 77
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype)
    h = torch.randn(rows, hidden, generator=g, dtype=dtype)
    out = lm_head(h, w)
    assert out.shape == (rows, vocab) and out.dtype == dtype
    assert torch.equal(out, F.linear(h, w))
