"""CUDA graphs for decode steps.

One graph per padded batch bucket (1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``; the last
bucket rounds ``max_num_seqs`` up to a multiple of 8), captured once at start-up, largest first,
all in one shared memory pool. Each graph reads its inputs from static buffers; a replay copies the
step's inputs into them. Padding rows (bucket size minus real sequences) write their K/V into the
reserved dummy block and attend to it alone, so they touch no real block. Prefill steps, and
decode batches above the largest bucket, run eagerly.

The attention metadata's ``max_seq_len`` is ``max_model_len`` both here and in eager GPU steps
(model_runner), so the decode kernel's grid (split-K partitions) is sized alike in both, and the
split-K choice counts the batch as ``attention.cuda.padded_decode_batch`` rounds it, the same for
a batch and its bucket (each bucket lies within one of that rounding's classes).
"""

from __future__ import annotations

import time

import torch

from prefixkv.attention import AttentionBackend, AttentionMetadata
from prefixkv.model.llama import LlamaModel
from prefixkv.progress import Task


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to ``max_num_seqs`` rounded up to one (up to 8:
    ``max_num_seqs`` itself last)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    buckets += list(range(16, max_num_seqs + 1, 8))
    if buckets[-1] != max_num_seqs:
        buckets.append(-(-max_num_seqs // 8) * 8 if max_num_seqs > 8 else max_num_seqs)
    return sorted(set(buckets))


class CudaGraphRunner:
    def __init__(
        self,
        model: LlamaModel,
        backend: AttentionBackend,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks + 1, KVH, block_size, D]
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
    ) -> None:
        self.model, self.backend, self.kv_cache = model, backend, kv_cache
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_num_seqs)
        self.dummy_block = kv_cache.shape[2] - 1
        dev = kv_cache.device
        n = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        # static inputs, shared by every bucket's graph (views of the first `bucket` rows)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), self.dummy_block * block_size, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.full((n, self.max_blocks), self.dummy_block, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.logits_rows = torch.arange(n, dtype=torch.int64, device=dev)
        # rows from num_filled on hold padding inputs (the dummy block only): a replay resets only the
        # rows an earlier, larger batch filled, not every padding row at every step
        self.num_filled = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # [bucket, vocab] logits, written by each replay
        self.pool = None
        self.warmup_seconds = 0.0  # the first eager pass (compiles the kernels a decode step uses)
        self.capture_seconds = 0.0  # the captures of every bucket (each after one eager pass)
        self.bucket_seconds: dict[int, float] = {}

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b], num_decode_seqs=b,
            max_seq_len=self.max_model_len, max_query_len=1)

    def _forward(self, b: int) -> torch.Tensor:
        return self.model(self.input_ids[:b], self.positions[:b], self.kv_cache,
                          [self._meta(b)] * len(self.kv_cache), self.backend, self.logits_rows[:b])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every bucket, largest first, into one memory pool; returns ``capture_seconds``
        (the warm-up pass that compiles the kernels is timed apart, in ``warmup_seconds``). The
        static inputs name only the dummy block while capturing."""
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device=self.kv_cache.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), Task("capturing CUDA graphs of decode steps", total=len(self.buckets) + 1,
                                             unit="graphs") as task:
            t0 = time.perf_counter()
            self._forward(self.buckets[-1])
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            self.warmup_seconds = t1 - t0
            task.update()  # (the warm-up pass: the kernels compile)
            for b in reversed(self.buckets):
                tb = time.perf_counter()
                self._forward(b)  # one eager pass at this shape before capturing it
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    self.outputs[b] = self._forward(b)
                self.graphs[b] = graph
                self.bucket_seconds[b] = time.perf_counter() - tb
                task.update(postfix=f"batch {b}")
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t1
        return self.capture_seconds

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Run a decode-only step (``meta.num_decode_seqs == num_seqs``); returns [num_seqs, vocab],
        a view of the graph's output that the next replay overwrites."""
        n = meta.num_seqs
        b = self.bucket_for(n)
        w = meta.block_tables.shape[1]
        if b is None or not 0 < n == meta.num_decode_seqs == input_ids.shape[0] or w > self.max_blocks:
            raise ValueError(f"replay: {n} sequences ({meta.num_decode_seqs} decodes, {input_ids.shape[0]} tokens, "
                             f"{w} blocks each) do not fit buckets {self.buckets} x {self.max_blocks} blocks")
        if meta.seq_lens_cpu and max(meta.seq_lens_cpu) > self.max_model_len:  # the graphs' split-K grid
            raise ValueError(f"replay: a sequence of {max(meta.seq_lens_cpu)} tokens is longer than the graphs' "
                             f"max_model_len {self.max_model_len}")
        self.num_filled = max(self.num_filled, n)  # first: a copy that raises leaves no row untracked
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :w].copy_(meta.block_tables)
        if n < self.num_filled:  # rows a larger batch filled become padding again: the dummy block only
            rows = slice(n, self.num_filled)
            self.input_ids[rows].zero_()
            self.positions[rows].zero_()
            self.slot_mapping[rows].fill_(self.dummy_block * self.block_size)
            self.seq_lens[rows].fill_(1)
            self.block_tables[rows, 0].fill_(self.dummy_block)
            self.num_filled = n
        self.graphs[b].replay()
        return self.outputs[b][:n]
