"""Decode-graph bucket sizes (CPU-side logic of the CUDA-graph runner)."""

from prefixkv.runner.cuda_graph import decode_buckets


def test_buckets():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(12) == [1, 2, 4, 8, 16]
    assert decode_buckets(3) == [1, 2, 3]
    assert decode_buckets(1) == [1]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 24]
