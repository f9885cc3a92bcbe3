"""The model runner: builds itself from the engine's configuration, then turns each
SchedulerOutput into tensors, runs the model and samples.

Construction (nano-vllm's ``ModelRunner``): load the model, plan its KV cache groups
(kv/groups.py), size and allocate the KV cache, choose the attention backend and batch invariance,
set up the lower tiers' worker (runner/tiers.py), capture the CUDA graphs.

Per step: run the lower tiers' copies, apply copy-on-write block copies, build input_ids /
positions and each KV cache group's slot_mapping / block_tables / seq_lens, run the forward pass
(logits only for rows that sample), sample.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from prefixkv import hugepages
from prefixkv.attention import AttentionBackend, AttentionMetadata, backend_for, kv_cache_shape
from prefixkv.config import EngineConfig
from prefixkv.kv.groups import KVGroupPlan, plan_kv_groups
from prefixkv.model.loader import DTYPES, load_hf_config, load_model, resolve_dtype
from prefixkv.progress import Task
from prefixkv.request import Request
from prefixkv.runner.block_table import BlockTables
from prefixkv.runner.memory import cuda_kv_cache_bytes
from prefixkv.runner.sampler import SamplingBatch, SamplerOutput, argmax_only, mix_seed, sample
from prefixkv.runner.tiers import TierWorker
from prefixkv.scheduler import SchedulerOutput
from prefixkv.spec_decode import accept_greedy

if TYPE_CHECKING:
    from prefixkv.runner.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)

# The KV cache on CPU where neither num_kv_blocks nor kv_cache_memory_bytes sets it (CacheConfig).
CPU_KV_CACHE_BYTES = 1 << 30


@dataclass
class ModelOutput:
    # sampled[i]: tokens for scheduled[i] (num_samples of them)
    sampled: list[list[int]]
    # logprobs[i][k]: (chosen logprob, [(token, logprob), ...], chosen's rank) for sample k, or None
    logprobs: list[list[tuple[float, list[tuple[int, float]], int]] | None]
    # prompt_logprobs[i]: for scheduled[i] if it wants them, (position p, prompt token p's logprob
    # given the tokens before it, its rank, [(token, logprob), ...]) for the prompt positions this
    # chunk predicts, in order; else None
    prompt_logprobs: list[list[tuple[int, float, int, list[tuple[int, float]]]] | None] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: Path, eos_token_ids: list[int]) -> None:
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' requested but torch sees no CUDA device")
        self.config = config
        self.device = torch.device(config.device)
        self.eos_token_ids = eos_token_ids
        self.dtype_name = resolve_dtype(config.dtype, config.device, load_hf_config(model_path))
        self.dtype = DTYPES[self.dtype_name]
        self.model, self.hf_config = load_model(model_path, self.dtype_name, config.device,
                                                cpu_linear=config.cpu_linear, cpu_ops=config.fused_cpu_ops)
        s = self.model.shape
        self.vocab_size = s.vocab_size
        self.max_model_len = self._max_model_len()
        self.block_size = bs = config.cache.block_size
        self.kv_plan = self._plan_kv_groups()
        self.backend, self.batch_invariant = self._attention_backend()
        self.num_pages = self._num_pages()
        # [layers_per_page, 2, num_pages + 1, KVH, block_size, D] (a model without sliding windows:
        # layers_per_page = num_layers); the last page is the dummy page. Layer i lives at slot
        # kv_plan.layer_slot[i] of the pages of its KV cache group.
        shape = kv_cache_shape(self.kv_plan.layers_per_page, self.num_pages, s.num_kv_heads, bs, s.head_dim)
        gib = math.prod(shape) * self.dtype.itemsize / (1 << 30)
        with Task(f"allocating the KV cache ({gib:.2f} GiB)", announce=False):
            if self.device.type == "cpu":  # huge pages: a block read touches one page, not several
                self.kv_cache = hugepages.empty(shape, dtype=self.dtype).zero_()
            else:
                self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.layer_caches = [self.kv_cache[slot] for slot in self.kv_plan.layer_slot]  # per layer: its view
        self.block_tables = [BlockTables(-(-self.max_model_len // bs)) for _ in self.kv_plan.windows]  # per group
        self.tiers = TierWorker.from_config(config.cache, self.kv_cache, model_path,
                                            (self.kv_plan.layer_group, self.kv_plan.layer_slot))
        self.graphs: CudaGraphRunner | None = None
        self.graph_capture_seconds = self._capture_cuda_graphs()

    def _max_model_len(self) -> int:
        config, s = self.config, self.model.shape
        max_len = config.max_model_len or s.max_position_embeddings
        if s.longrope_short_max is not None and max_len > s.longrope_short_max:
            # past its original length transformers' LongRoPE switches every position to the long
            # factors (recomputing the cache): outputs that a paged cache cannot reproduce yet
            if config.max_model_len is not None:
                raise ValueError(f"max_model_len: {s.model_type}'s LongRoPE is served up to its original "
                                 f"{s.longrope_short_max} tokens (the short factors); got {config.max_model_len}")
            logger.warning("max_model_len: %s's LongRoPE is served up to its original %d tokens (the short "
                           "factors), not %d", s.model_type, s.longrope_short_max, max_len)
            max_len = s.longrope_short_max
        return max_len

    def _plan_kv_groups(self) -> KVGroupPlan:
        """KV cache groups for this model: by attention type when some layers are windowed, unless disabled."""
        s = self.model.shape
        plan = plan_kv_groups(s.layer_windows or (None,) * s.num_layers,
                              not self.config.cache.disable_hybrid_kv_cache_manager)
        if plan.hybrid:
            logger.info("kv cache: %d groups of %d layers (windows %s); out-of-window blocks are freed",
                        plan.num_groups, plan.layers_per_page, list(plan.windows))
        return plan

    def _num_pages(self) -> int:
        """Pages in the KV cache. A page holds one block of the layers of one group (every layer,
        without groups); ``num_kv_blocks`` counts whole-model blocks: the same memory in pages."""
        cfg, s, lpg = self.config, self.model.shape, self.kv_plan.layers_per_page
        if cfg.cache.num_kv_blocks:
            return cfg.cache.num_kv_blocks * s.num_layers // lpg
        if cfg.cache.kv_cache_memory_bytes is not None:
            budget = cfg.cache.kv_cache_memory_bytes
        elif cfg.device != "cuda":
            budget = CPU_KV_CACHE_BYTES
        else:
            budget = cuda_kv_cache_bytes(self.model, self.backend.name, cfg.gpu_memory_utilization,
                                         cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs,
                                         self.max_model_len)
        return max(1, budget // self.bytes_per_block(self.model, self.block_size, self.dtype, lpg))

    def _attention_backend(self) -> tuple[AttentionBackend, bool]:
        """The attention backend, and whether this runner is batch-invariant (on wherever it can be,
        unless ``batch_invariant=False``; ``True`` where it cannot be is a ValueError)."""
        cfg = self.config
        s = self.model.shape
        backend = backend_for(cfg.attention_backend, cfg.device, self.dtype, s.num_heads, s.num_kv_heads, s.head_dim)
        if cfg.batch_invariant is False:
            return backend, False
        why = self._batch_invariance_blocker(backend)
        if why is not None and cfg.batch_invariant:
            raise ValueError(f"batch_invariant: {why}")
        backend.batch_invariant = why is None
        return backend, why is None

    def _batch_invariance_blocker(self, backend: AttentionBackend) -> str | None:
        """Why this runner cannot be batch-invariant, or None. The mode needs every op of the
        forward pass to compute a row the same way whatever the other rows: on CPU in float32 the
        C GEMM (rows bitwise independent of M), the fused C elementwise kernels and the C
        attention backend with one routine per query token (attention/cpu.py)."""
        from prefixkv.model.linear import Linear

        cfg = self.config
        if cfg.device != "cpu" or self.dtype != torch.float32:
            return f"is implemented for device 'cpu' in float32 (got {cfg.device!r}, {self.dtype_name})"
        if backend.name != "cpu":
            return f"needs attention_backend 'cpu' (got {backend.name!r})"
        if any(m.kind != "c" for m in self.model.modules() if isinstance(m, Linear)):
            return "needs cpu_linear 'c' (the C GEMM: oneDNN's and MKL's rows depend on the batch size)"
        if not (cfg.fused_cpu_ops and self.model.model.norm.fused):
            return "needs fused_cpu_ops (the C RMSNorm, RoPE and SiLU kernels)"
        s = self.model.shape
        return backend.batch_invariance_blocker(s.num_heads, cfg.cache.block_size, s.head_dim, self.dtype)

    def _capture_cuda_graphs(self) -> float:
        """Decode graphs for every batch bucket (CUDA, the CUDA backend, not ``enforce_eager``);
        returns the capture time in seconds."""
        cfg, s = self.config, self.model.shape
        if cfg.device != "cuda" or cfg.enforce_eager or self.backend.name != "cuda":
            return 0.0
        if s.is_moe:  # the torch MoE path picks each step's experts on the host: no graph holds it
            logger.warning("model: %s's sparse MoE layers route on the host; decode runs eagerly (no CUDA graphs)",
                           s.model_type)
            return 0.0
        if self.kv_plan.num_groups > 1:  # the graphs hold one block table
            logger.warning("model: %s's KV cache groups (sliding-window layers) decode eagerly (no CUDA graphs)",
                           s.model_type)
            return 0.0
        from prefixkv.runner.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_cache, cfg.scheduler.max_num_seqs,
                                      self.max_model_len, self.block_size)
        return self.graphs.capture()

    @staticmethod
    def bytes_per_block(model, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
        """Bytes of one block of KV for every layer (or for ``num_layers`` layers: a page)."""
        s = model.shape
        return ((num_layers or s.num_layers) * 2 * s.num_kv_heads * block_size * s.head_dim
                * torch.empty((), dtype=dtype).element_size())

    # ------------------------------------------------------------------ inputs
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata],
                                                     torch.Tensor | None]:
        """Step inputs: input ids, positions, the attention metadata of each KV cache group, and
        the logits rows (one per sampling sequence: a fork step's n samples share it; None where
        that is every row, in order: a step of decodes). Host work follows this step's tokens and
        new blocks: the block tables are the runner's persistent copies (``BlockTables``, one per
        group), updated by the step's deltas."""
        groups = self.block_tables
        for t in groups:
            t.release(out.released_seq_ids)
        rows: list[list[int]] = [[] for _ in groups]  # per group: each sequence's row of its table
        computed: list[int] = []
        counts: list[int] = []
        input_ids: list[int] = []
        logits_rows: list[int] = []
        end = 0
        for s in out.scheduled:
            sid, delta = s.req.seq_id, s.block_delta
            if delta is None:
                for t, r in zip(groups, rows):
                    row = t.rows.get(sid)
                    r.append(t.apply(sid, None) if row is None else row)
            else:
                for t, r, ids in zip(groups, rows, delta.blocks):
                    r.append(t.apply(sid, (delta.start, ids)))
            computed.append(s.num_computed_tokens)
            counts.append(s.num_scheduled_tokens)
            input_ids.extend(s.token_ids)
            start, end = end, end + s.num_scheduled_tokens
            if s.draft:  # every verified position samples
                logits_rows.extend(range(start, end))
            elif s.num_samples:
                logits_rows.append(end - 1)
        computed_np = np.asarray(computed, dtype=np.int64)
        counts_np = np.asarray(counts, dtype=np.int64)
        seq_lens = computed_np + counts_np
        starts = np.zeros(len(computed) + 1, dtype=np.int64)
        np.cumsum(counts_np, out=starts[1:])
        decodes = end == len(computed)  # one token per sequence
        positions = computed_np if decodes else (np.repeat(computed_np - starts[:-1], counts_np)
                                                 + np.arange(end, dtype=np.int64))
        dev = self.device
        on_dev = (lambda t: t) if dev.type == "cpu" else (lambda t: t.to(dev))  # (no dispatch on CPU)
        seq_lens_cpu, starts_cpu = seq_lens.tolist(), starts.tolist()
        query_start_loc = on_dev(torch.from_numpy(starts.astype(np.int32)))
        seq_lens_dev = on_dev(torch.from_numpy(seq_lens.astype(np.int32)))
        max_blocks = int(groups[0].num_blocks[np.asarray(rows[0], dtype=np.int64)].max())  # (every group's alike)
        # an upper bound: on the GPU the decode kernel's grid then matches the captured graphs'
        # (sized for max_model_len), and its split-K choice too (attention/cuda.decode_split_k
        # rounds the batch as the buckets do), so a batch's arithmetic does not depend on whether
        # it fits a graph bucket
        max_seq_len = self.max_model_len if dev.type == "cuda" else max(seq_lens_cpu)
        max_query_len = int(counts_np.max())
        bs = self.block_size
        metas = []
        for t, g_rows in zip(groups, rows):  # the same batch through each group's tables
            g_np = np.asarray(g_rows, dtype=np.int64)
            tok_rows = g_np if decodes else np.repeat(g_np, counts_np)
            slots = t.table[tok_rows, positions // bs].astype(np.int64) * bs + positions % bs
            metas.append(AttentionMetadata(
                slot_mapping=on_dev(torch.from_numpy(slots)),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_dev,
                block_tables=on_dev(torch.from_numpy(t.gather(g_rows, max_blocks))),
                num_decode_seqs=out.num_decodes,
                max_seq_len=max_seq_len,
                max_query_len=max_query_len,
                seq_lens_cpu=seq_lens_cpu,
                query_start_loc_cpu=starts_cpu,
            ))
        # logits rows increase, so as many as the step's tokens are every row in order (None)
        return (torch.tensor(input_ids, dtype=torch.int64, device=dev), on_dev(torch.from_numpy(positions)), metas,
                None if len(logits_rows) == end else torch.tensor(logits_rows, dtype=torch.int64, device=dev))

    def sampling_batch(self, rows: list[tuple[Request, int]]) -> SamplingBatch:
        """rows: (request, sample_index) per token to sample."""
        dev, v = self.device, self.vocab_size
        params = [r.sampling_params for r, _ in rows]
        b = SamplingBatch(
            all_greedy=all(p.greedy for p in params),
            any_top_k=any(0 < p.top_k < v for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            any_min_p=any(p.min_p > 0.0 for p in params),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )
        if not b.all_greedy:  # (a greedy batch takes the argmax alone: six tensors fewer a step)
            b.temperature = torch.tensor([p.temperature for p in params], dtype=torch.float64, device=dev)
            b.top_k = torch.tensor([min(p.top_k, v) if p.top_k > 0 else v for p in params], dtype=torch.int64,
                                   device=dev)
            b.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
            b.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=dev)
            b.seeds = torch.tensor([mix_seed(r.seed, k) for r, k in rows], dtype=torch.int64, device=dev)
            b.positions = torch.tensor([r.num_output_tokens for r, _ in rows], dtype=torch.int64, device=dev)
        if any(p.uses_penalties for p in params):
            b.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float64, device=dev)
            b.presence_penalty = torch.tensor([p.presence_penalty for p in params], dtype=torch.float64, device=dev)
            b.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float64, device=dev)
            counts = torch.zeros((len(rows), v), dtype=torch.int64, device=dev)
            seen = torch.zeros((len(rows), v), dtype=torch.bool, device=dev)
            for i, (r, _) in enumerate(rows):
                out_ids = torch.tensor(r.output_token_ids, dtype=torch.int64, device=dev)
                counts[i].scatter_add_(0, out_ids, torch.ones_like(out_ids))
                seen[i, torch.frombuffer(r.token_ids, dtype=torch.int64).to(dev)] = True
            b.output_counts, b.seen_mask = counts, seen
        banned, biases, allowed_only = [], [], []
        for i, (r, _) in enumerate(rows):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids))
                if ids:
                    banned.append((i, ids))
            if p.bad_words_token_ids:  # a word's last token, where the output ends with the rest of it
                n_out = r.num_output_tokens
                out = r.token_ids
                ids = [w[-1] for w in p.bad_words_token_ids
                       if len(w) - 1 <= n_out and out[len(out) - len(w) + 1:len(out)].tolist() == w[:-1]]
                if ids:
                    banned.append((i, ids))
            if p.logit_bias:
                biases.append((i, torch.tensor(list(p.logit_bias), dtype=torch.int64, device=dev),
                               torch.tensor(list(p.logit_bias.values()), dtype=torch.float64, device=dev)))
            if p.allowed_token_ids:
                allowed_only.append((i, torch.tensor(p.allowed_token_ids, dtype=torch.int64, device=dev)))
        b.banned, b.biases, b.allowed_only = banned or None, biases or None, allowed_only or None
        constrained = [(i, r.matcher) for i, (r, _) in enumerate(rows) if r.matcher is not None]
        if constrained:
            from prefixkv.structured_outputs import fill_bitmask

            b.constrained_rows = torch.tensor([i for i, _ in constrained], dtype=torch.int64, device=dev)
            b.allowed = torch.from_numpy(fill_bitmask([m for _, m in constrained], v)).to(dev)
        return b

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelOutput:
        """The step's lower-tier copies (runner/tiers.py), then its forward pass and sampling."""
        t0 = time.perf_counter()
        self.tiers.wait_for_copies()
        if out.tiers.has_copies:
            self.tiers.execute(out.tiers)
        if not out.scheduled:  # a step of copies only (requests put off to the next step)
            return ModelOutput([], [], None)
        model_out = self._forward(out)
        self.tiers.last_forward_s = time.perf_counter() - t0
        return model_out

    def _forward(self, out: SchedulerOutput) -> ModelOutput:
        if out.copy_ops:
            pairs = torch.tensor([[op.src, op.dst] for op in out.copy_ops], dtype=torch.int64)  # host: checked there
            self.backend.copy_blocks(self.kv_cache, pairs)
        input_ids, positions, metas, logits_rows = self.prepare(out)
        layer_metas = [metas[g] for g in self.kv_plan.layer_group]
        prompt_rows = self._prompt_logprob_rows(out)
        if prompt_rows:  # their logits too, after the sampling rows
            n = input_ids.shape[0]
            logits_rows = torch.cat([torch.arange(n, device=self.device) if logits_rows is None else logits_rows,
                                     torch.tensor([r for r, _, _ in prompt_rows], dtype=torch.int64,
                                                  device=self.device)])
        rows: list[tuple[Request, int]] = []  # (request, sample index) per token to sample
        repeats: list[int] = []  # per row of logits: how many of those tokens it serves
        for s in out.scheduled:
            req = s.req
            if s.draft:  # one row per verified position
                rows += [(req, req.sample_index)] * (1 + len(s.draft))
                repeats += [1] * (1 + len(s.draft))
            elif s.num_samples:  # the n samples of a fork step share one row of logits
                rows += [(req, k if req.needs_fork else req.sample_index) for k in range(s.num_samples)]
                repeats.append(s.num_samples)
        batch = self.sampling_batch(rows) if rows else None
        graph = self._graph_step(out)
        num_logit_rows = input_ids.shape[0] if logits_rows is None else logits_rows.shape[0]
        if (batch is not None and not prompt_rows and not graph and len(rows) == num_logit_rows
                and argmax_only(batch) and self.model.greedy_head_ok):
            # every row of logits samples one token, its argmax (a decode step's rows, or a prefill
            # step's last prompt rows and decodes): the model's C LM head takes it, no logits written
            tokens = self.model(input_ids, positions, self.layer_caches, layer_metas, self.backend, logits_rows,
                                greedy=True)
            return self._split(out, SamplerOutput(tokens.tolist(), None, None, None, None))
        if graph:
            logits = self.graphs.replay(input_ids, positions, metas[0])
        else:
            logits = self.model(input_ids, positions, self.layer_caches, layer_metas, self.backend, logits_rows)
        prompt_lps = None
        if prompt_rows:
            n = logits.shape[0] - len(prompt_rows)
            prompt_lps = self._prompt_logprobs(out, logits[n:], prompt_rows)
            logits = logits[:n]
        if not rows:
            return ModelOutput([[] for _ in out.scheduled], [None for _ in out.scheduled], prompt_lps)
        if len(rows) != logits.shape[0]:
            logits = logits.repeat_interleave(torch.tensor(repeats, device=logits.device), dim=0)
        res = sample(logits, batch)
        model_out = self._split(out, res)
        model_out.prompt_logprobs = prompt_lps
        return model_out

    @staticmethod
    def _prompt_logprob_rows(out: SchedulerOutput) -> list[tuple[int, int, int]]:
        """(row of the step's flattened tokens, scheduled index, position p of the prompt token that
        row predicts) for every prompt token after the first that this step's chunks predict, of
        the requests that want prompt logprobs."""
        rows = []
        if out.num_decodes == len(out.scheduled):
            return rows  # decodes only: no prompt token is computed
        start = 0
        for i, s in enumerate(out.scheduled):
            req = s.req
            if req.sampling_params.prompt_logprobs is not None and not s.draft:
                c = s.num_computed_tokens
                for j in range(c, min(c + s.num_scheduled_tokens, req.num_prompt_tokens - 1)):
                    rows.append((start + j - c, i, j + 1))
            start += s.num_scheduled_tokens
        return rows

    @staticmethod
    def _prompt_logprobs(out: SchedulerOutput, logits: torch.Tensor,
                         prompt_rows: list[tuple[int, int, int]]) -> list[list | None]:
        lp = torch.log_softmax(logits.float() if logits.dtype != torch.float64 else logits, dim=-1)
        toks = torch.tensor([out.scheduled[i].req.token_ids[p] for _, i, p in prompt_rows], dtype=torch.int64,
                            device=lp.device)
        chosen = lp.gather(1, toks[:, None])
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        chosen = chosen[:, 0].tolist()
        k = max(out.scheduled[i].req.sampling_params.prompt_logprobs for _, i, _ in prompt_rows)
        top_ids = top_vals = None
        if k:
            top = torch.topk(lp, k, dim=-1)
            top_ids, top_vals = top.indices.tolist(), top.values.tolist()
        result: list[list | None] = [None] * len(out.scheduled)
        for r, (_, i, p) in enumerate(prompt_rows):
            ki = out.scheduled[i].req.sampling_params.prompt_logprobs
            tops = list(zip(top_ids[r][:ki], top_vals[r][:ki])) if ki and top_ids else []
            if result[i] is None:
                result[i] = []
            result[i].append((p, chosen[r], ranks[r], tops))
        return result

    def _graph_step(self, out: SchedulerOutput) -> bool:
        n = len(out.scheduled)
        return (self.graphs is not None and out.num_decodes == n and self.graphs.bucket_for(n) is not None
                and all(s.num_samples == 1 for s in out.scheduled))

    @staticmethod
    def _split(out: SchedulerOutput, res: SamplerOutput) -> ModelOutput:
        sampled, logprobs = [], []
        i = 0
        for s in out.scheduled:
            if s.draft:  # greedy at every verified position; each kept token's logprobs from its row
                toks = accept_greedy(s.draft, res.token_ids[i:i + 1 + len(s.draft)])
                n_rows = 1 + len(s.draft)
            else:
                toks = res.token_ids[i:i + s.num_samples]
                n_rows = s.num_samples
            sampled.append(toks)
            lp = None
            if toks and s.req.sampling_params.logprobs is not None and res.chosen_logprobs is not None:
                k = s.req.sampling_params.logprobs
                lp = []
                for j in range(i, i + len(toks)):
                    top = list(zip(res.top_ids[j][:k], res.top_logprobs[j][:k])) if k and res.top_ids else []
                    lp.append((res.chosen_logprobs[j], top, res.chosen_ranks[j]))
            logprobs.append(lp)
            i += n_rows
        return ModelOutput(sampled, logprobs)
