"""Model-level pieces that the lossless tests cannot see on tiny vocabularies."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv.model.llama import _LM_HEAD_SLICE, lm_head


@pytest.mark.parametrize("rows", [1, 2, 7, 16, 33, 64, 130])
@pytest.mark.parametrize("hidden", [96, 576])
def test_sliced_lm_head_is_bit_identical(rows, hidden):
    """The float32 CPU LM head runs over vocabulary slices; every logit must equal F.linear's
    exactly (a vocabulary that is not a multiple of the slice included; SmolLM2's hidden size).
    Observed with MKL's sgemm; another BLAS may round a dot product differently per call shape."""
    g = torch.Generator().manual_seed(rows)
    vocab = 3 * _LM_HEAD_SLICE + 77
    w = torch.randn(vocab, hidden, generator=g)
    h = torch.randn(rows, hidden, generator=g)
    out = lm_head(h, w)
    assert out.shape == (rows, vocab) and out.dtype == torch.float32
    if torch.backends.mkl.is_available():
        assert torch.equal(out, F.linear(h, w))
    else:
        torch.testing.assert_close(out, F.linear(h, w))


def test_float64_lm_head_is_one_matmul(monkeypatch):
    """dgemm is not bit-identical across slicings, so float64 (the exactness tests' dtype) keeps
    the single F.linear call."""
    calls = []
    monkeypatch.setattr(torch, "mm", lambda *a, **k: calls.append(a))
    w = torch.randn(3 * _LM_HEAD_SLICE, 16, dtype=torch.float64)
    h = torch.randn(4, 16, dtype=torch.float64)
    assert torch.equal(lm_head(h, w), F.linear(h, w)) and calls == []
