"""Benchmarks of prefixkv's parts without (or beside) the model:

    sched-overhead  CPU µs per scheduled request per step, the Scheduler driven with fake sampled
                    tokens (and the runner's input building, and optionally a whole engine step)
    memory          how many requests fit at once in a fixed KV budget: paged blocks (the real
                    Scheduler, fake runner) vs reserving each request's max length contiguously
    flops           machine matmul GFLOP/s, measured in the same run, and the fraction of it the
                    systems reach on decode-heavy work (model FLOPs ~ 2 x params x tokens)
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from array import array
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from bench.run import _loadavg, machine_info, rewrite_result, write_result

FAKE_TOKEN = 1000


def _requests(n: int, prompt_tokens: int, vocab: int = 49152):
    from prefixkv.request import Request
    from prefixkv.sampling_params import SamplingParams

    rng = random.Random(0)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    return [Request(f"r{i}", [rng.randrange(3, vocab) for _ in range(prompt_tokens)], params, i, 0)
            for i in range(n)]


def _fake_sampled(out, tok: int = FAKE_TOKEN) -> list[list[int]]:
    return [[tok] * s.num_samples for s in out.scheduled]


def _sampling_rows(out) -> list:
    """(request, sample index) per token to sample, for ``ModelRunner.sampling_batch``."""
    return [(s.req, 0) for s in out.scheduled for _ in range(s.num_samples)]


# ------------------------------------------------------------------------------------------ scheduler
def scheduler_overhead(num_running: int, steps: int, prompt_tokens: int, block_size: int = 16,
                       prefix_caching: bool = True) -> dict:
    import torch

    from prefixkv.config import CacheConfig, SchedulerConfig
    from prefixkv.runner.block_table import BlockTables
    from prefixkv.runner.model_runner import ModelRunner
    from prefixkv.scheduler import Scheduler

    num_blocks = num_running * (-(-(prompt_tokens + steps + 8) // block_size) + 1) + 16
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running),
                      CacheConfig(block_size=block_size, num_kv_blocks=num_blocks,
                                  enable_prefix_caching=prefix_caching), num_blocks)
    for r in _requests(num_running, prompt_tokens):
        sched.add_request(r)
    runner = SimpleNamespace(block_size=block_size, device=torch.device("cpu"), vocab_size=49152,
                             eos_token_ids=[2], max_model_len=1 << 30,
                             block_tables=[BlockTables(-(-(prompt_tokens + steps + 8) // block_size))])
    while True:  # prefill everything, untimed
        out = sched.schedule()
        all_decode = out.num_decodes == num_running  # (a property of the live requests: read before update)
        ModelRunner.prepare(runner, out)  # (the runner's block tables follow every step)
        sched.update(out, _fake_sampled(out))
        if all_decode:
            break
    t_sched = t_update = t_prepare = t_sbatch = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        ModelRunner.prepare(runner, out)
        t2 = time.perf_counter()
        ModelRunner.sampling_batch(runner, _sampling_rows(out))
        t3 = time.perf_counter()
        sched.update(out, _fake_sampled(out))
        t4 = time.perf_counter()
        assert len(out.scheduled) == num_running
        t_sched += t1 - t0
        t_prepare += t2 - t1
        t_sbatch += t3 - t2
        t_update += t4 - t3
    per = 1e6 / (steps * num_running)
    return dict(num_running=num_running, steps=steps, context_tokens_end=prompt_tokens + steps,
                schedule_us_per_req=round(t_sched * per, 3), update_us_per_req=round(t_update * per, 3),
                scheduler_us_per_req=round((t_sched + t_update) * per, 3),
                runner_prepare_us_per_req=round(t_prepare * per, 3),
                sampling_batch_us_per_req=round(t_sbatch * per, 3),
                scheduler_ms_per_step=round((t_sched + t_update) * 1e3 / steps, 3))


def engine_overhead(llm, num_running: int, steps: int, prompt_tokens: int) -> dict:
    """A whole ``LLMEngine.step`` with the model forward replaced by fake tokens (scheduler, runner
    input building, sampling-batch building, engine bookkeeping and detokenization)."""
    from prefixkv import SamplingParams
    from prefixkv.runner.model_runner import ModelOutput

    eng = llm.engine
    runner = eng.runner
    real_execute = runner.execute
    tok = min(FAKE_TOKEN, eng.info.vocab_size - 1)

    def fake_execute(out):
        runner.prepare(out)
        rows = _sampling_rows(out)
        if rows:
            runner.sampling_batch(rows)
        return ModelOutput(_fake_sampled(out, tok), [None] * len(out.scheduled))

    runner.execute = fake_execute
    try:
        rng = random.Random(1)
        v = eng.info.vocab_size
        for i in range(num_running):
            eng.add_request(f"ov{num_running}-{i}", [rng.randrange(3, v) for _ in range(prompt_tokens)],
                            SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True))
        while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_tokens - 1 for r in eng.scheduler.running):
            eng.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        dt = time.perf_counter() - t0
        for i in range(num_running):
            eng.abort(f"ov{num_running}-{i}")
    finally:
        runner.execute = real_execute
    return dict(num_running=num_running, engine_step_us_per_req=round(dt * 1e6 / (steps * num_running), 3),
                engine_ms_per_step=round(dt * 1e3 / steps, 3))


def cmd_sched_overhead(args: argparse.Namespace, command: str) -> int:
    sizes = [int(x) for x in args.sizes.split(",")]
    load0 = _loadavg()
    rows = []
    for n in sizes:
        rows.append(scheduler_overhead(n, args.steps, args.prompt_tokens, args.block_size))
        print(f"{n:>4} running: scheduler {rows[-1]['scheduler_us_per_req']:.1f} µs/req/step "
              f"(schedule {rows[-1]['schedule_us_per_req']:.1f} + update {rows[-1]['update_us_per_req']:.1f}), "
              f"runner.prepare {rows[-1]['runner_prepare_us_per_req']:.1f}, "
              f"sampling_batch {rows[-1]['sampling_batch_us_per_req']:.1f}", flush=True)
    if args.engine:
        from prefixkv import LLM

        llm = LLM(model=args.model, dtype=args.dtype, block_size=args.block_size, max_num_seqs=max(sizes),
                  max_num_batched_tokens=max(2048, max(sizes)),
                  num_kv_blocks=max(sizes) * (-(-(args.prompt_tokens + args.steps + 80) // args.block_size) + 1))
        for row in rows:
            row.update(engine_overhead(llm, row["num_running"], args.steps, args.prompt_tokens))
            print(f"{row['num_running']:>4} running: whole engine step (fake model) "
                  f"{row['engine_step_us_per_req']:.1f} µs/req/step, {row['engine_ms_per_step']:.1f} ms/step", flush=True)
    doc = dict(workload="sched-overhead", command=command, params=dict(steps=args.steps, prompt_tokens=args.prompt_tokens,
               block_size=args.block_size), machine=machine_info(args.threads), loadavg_start=load0,
               loadavg_end=_loadavg(), results=rows)
    stem = args.stem or f"sched-overhead-{time.strftime('%Y%m%d-%H%M%S')}"
    path = write_result(doc, args.out, stem)
    if not args.no_plot:
        from bench.report import plot_series

        series = {"scheduler (schedule+update)": [r["scheduler_us_per_req"] for r in rows],
                  "runner.prepare": [r["runner_prepare_us_per_req"] for r in rows],
                  "sampling_batch": [r["sampling_batch_us_per_req"] for r in rows]}
        if args.engine:
            series["whole engine step (fake model)"] = [r["engine_step_us_per_req"] for r in rows]
        plot_series(sizes, series, "running requests", "CPU µs per scheduled request per step",
                    "per-step CPU overhead", path.with_suffix(".png"), logx=True)
    print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------------------------ memory
def _trace(n: int, min_p: int, max_p: int, min_o: int, max_o: int, seed: int):
    rng = random.Random(seed)
    return [(rng.randint(min_p, max_p), rng.randint(min_o, max_o)) for _ in range(n)]


def simulate_paged(trace, budget_tokens: int, block_size: int, max_num_seqs: int, step_tokens: int,
                   watermark: float = 0.01) -> dict:
    from prefixkv.config import CacheConfig, SchedulerConfig
    from prefixkv.request import Request, RequestStatus
    from prefixkv.sampling_params import SamplingParams
    from prefixkv.scheduler import Scheduler

    num_blocks = budget_tokens // block_size
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=step_tokens, max_num_seqs=max_num_seqs,
                                      max_waiting_requests=len(trace) + 1, watermark=watermark,
                                      max_admitted_prefill_tokens=None),  # as recorded (memory.json)
                      CacheConfig(block_size=block_size, num_kv_blocks=num_blocks, enable_prefix_caching=False),
                      num_blocks)
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True)
    targets = {}
    for i, (p, o) in enumerate(trace):
        req = Request(f"m{i}", [3 + (i * 31 + k) % 40000 for k in range(p)], params, i, 0)
        targets[req.seq_id] = o
        sched.add_request(req)
    running, util, steps = [], [], 0
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        held = slots = 0
        for s in out.scheduled:
            held += s.num_computed_tokens + s.num_scheduled_tokens
            slots += len(sched.kv.block_tables[s.req.seq_id][0]) * block_size
        running.append(len(sched.running))
        if slots:
            util.append(held / slots)
        for req in sched.update(out, _fake_sampled(out)):
            if req.num_output_tokens >= targets[req.seq_id]:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        assert steps < 10_000_000
    return dict(policy=f"paged (block_size={block_size}, watermark={watermark})", peak_running=max(running),
                mean_running=round(statistics.fmean(running), 2), steps=steps,
                kv_util=round(statistics.fmean(util), 4), num_preemptions=sched.num_preemptions)


def simulate_contiguous(trace, budget_tokens: int, reserve, max_num_seqs: int, step_tokens: int, label: str) -> dict:
    """FCFS; a request is admitted when its reservation ``reserve(p, o)`` fits in what is left of
    the budget (no external fragmentation counted: the best case for contiguous allocation). Each
    step gives running requests, oldest first, their remaining prompt (chunked) or one token."""
    waiting = list(range(len(trace)))
    run: list[list[int]] = []  # [idx, computed, generated, reserved]
    free = budget_tokens
    running, util, steps = [], [], 0
    while waiting or run:
        budget = step_tokens
        for r in run:
            p, _ = trace[r[0]]
            need = p - r[1] if r[1] < p else 1
            take = min(need, budget)
            budget -= take
            r[1] += take if r[1] < p else 0
            if r[1] >= p and take == need:
                r[2] += 1
            if budget <= 0:
                break
        while waiting and budget > 0 and len(run) < max_num_seqs:
            p, o = trace[waiting[0]]
            res = reserve(p, o)
            if res > free:
                break
            free -= res
            idx = waiting.pop(0)
            take = min(p, budget)
            budget -= take
            run.append([idx, take, 1 if take == p else 0, res])
        steps += 1
        running.append(len(run))
        held = sum(min(r[1] + r[2], r[3]) for r in run)
        if run:
            util.append(held / sum(r[3] for r in run))
        keep = []
        for r in run:
            if r[2] >= trace[r[0]][1]:
                free += r[3]
            else:
                keep.append(r)
        run = keep
        if not run and waiting and reserve(*trace[waiting[0]]) > budget_tokens:
            raise ValueError(f"{label}: a request needs more than the whole budget")
    return dict(policy=label, peak_running=max(running), mean_running=round(statistics.fmean(running), 2),
                steps=steps, kv_util=round(statistics.fmean(util), 4), num_preemptions=0)


def cmd_memory(args: argparse.Namespace, command: str) -> int:
    trace = _trace(args.num_requests, args.min_prompt, args.max_prompt, args.min_output, args.max_output, args.seed)
    big = max(args.num_requests, 1)
    step_tokens = 2048
    load0 = _loadavg()
    rows = [simulate_paged(trace, args.budget_tokens, args.block_size, big, step_tokens, wm)
            for wm in (0.01, 0.0, 0.05)]  # the default first: the ratios below compare against it
    rows.append(simulate_contiguous(trace, args.budget_tokens, lambda p, o: p + args.max_output, big, step_tokens,
                                    f"contiguous, reserve prompt + max_tokens={args.max_output}"))
    rows.append(simulate_contiguous(trace, args.budget_tokens, lambda p, o: p + o, big, step_tokens,
                                    "contiguous, reserve prompt + actual output (oracle)"))
    rows.append(simulate_contiguous(trace, args.budget_tokens, lambda p, o: args.max_model_len, big, step_tokens,
                                    f"contiguous, reserve max_model_len={args.max_model_len}"))
    for r in rows:
        print(f"{r['policy']:<60} peak {r['peak_running']:>4} running, mean {r['mean_running']:>7.1f}, "
              f"{r['steps']:>6} steps, KV util {r['kv_util']:.3f}, preemptions {r['num_preemptions']}")
    doc = dict(workload="memory", command=command,
               params=dict(num_requests=args.num_requests, budget_tokens=args.budget_tokens,
                           max_model_len=args.max_model_len, prompt=[args.min_prompt, args.max_prompt],
                           output=[args.min_output, args.max_output], block_size=args.block_size,
                           step_tokens=step_tokens, seed=args.seed,
                           mean_prompt=statistics.fmean(p for p, _ in trace),
                           mean_output=statistics.fmean(o for _, o in trace)),
               machine=machine_info(args.threads), loadavg_start=load0, results=rows,
               mean_running_ratio_paged_vs_contiguous={r["policy"]: round(rows[0]["mean_running"] / r["mean_running"], 3)
                                                      for r in rows[3:]})
    stem = args.stem or f"memory-{time.strftime('%Y%m%d-%H%M%S')}"
    path = write_result(doc, args.out, stem)
    print(f"wrote {path}")
    return 0


# ------------------------------------------------------------------------------------------ flops
def matmul_gflops(m: int, k: int, n: int, seconds: float = 1.0, dtype: str = "float32") -> dict:
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(m, k, dtype=dt), torch.randn(k, n, dtype=dt)
    for _ in range(3):
        a @ b
    rates = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(rates) < 5:
        t0 = time.perf_counter()
        a @ b
        rates.append(2 * m * k * n / (time.perf_counter() - t0) / 1e9)
    return dict(shape=[m, k, n], best_gflops=round(max(rates), 2), median_gflops=round(statistics.median(rates), 2))


def model_flops(hf_config, prompt_tokens_computed: int, output_tokens: int, num_sequences: int) -> dict:
    """2 x params x tokens; the matmul count splits out the LM head (only sampled rows pay it)."""
    h, v = hf_config.hidden_size, hf_config.vocab_size
    L, inter = hf_config.num_hidden_layers, hf_config.intermediate_size
    nh = hf_config.num_attention_heads
    kvh = getattr(hf_config, "num_key_value_heads", nh) or nh
    d = getattr(hf_config, "head_dim", None) or h // nh
    per_layer = h * nh * d + 2 * h * kvh * d + nh * d * h + 3 * h * inter
    nonembed = L * per_layer
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    total = nonembed + v * h * (1 if tied else 2)
    tokens = prompt_tokens_computed + output_tokens - num_sequences  # the last output token is never fed back
    return dict(params_total=total, params_nonembedding=nonembed,
                flops_simple=2 * total * tokens,
                flops_matmul=2 * nonembed * tokens + 2 * v * h * output_tokens, tokens_computed=tokens)


def cmd_flops(args: argparse.Namespace, command: str) -> int:
    from bench import workloads as wl
    from bench.cli_impl import engine_args, load_tokenizer
    from bench.corpus import TokenStream
    from bench.report import ratio_table, table
    from bench.run import run_and_report
    from bench.systems import make_system
    from prefixkv.model.loader import load_hf_config

    path, tok = load_tokenizer(args.model)
    hf_cfg = load_hf_config(path)
    h, inter = hf_cfg.hidden_size, hf_cfg.intermediate_size
    shapes = [(1024, 1024, 1024), (512, h, inter), (args.num_requests, h, inter)]
    before = [matmul_gflops(*s, dtype=args.dtype) for s in shapes]
    pb = wl.PromptBuilder(tok, TokenStream.build(tok))
    reqs = [wl.BenchRequest(pb.block(args.prompt_tokens, wl.USER_HEAD, wl.END + wl.ASSISTANT_HEAD), args.output_tokens)
            for _ in range(args.num_requests)]
    w = wl.Workload("flops", dict(num_requests=args.num_requests, prompt_tokens=args.prompt_tokens,
                                  output_tokens=args.output_tokens), rounds=[reqs])
    ea = engine_args(args)
    systems = [make_system(n.strip(), ea, path) for n in args.systems.split(",") if n.strip()]
    doc = run_and_report(w, systems, repeat=args.repeat, out_dir=args.out, command=command, threads=args.threads,
                         engine_args=asdict(ea), plot=not args.no_plot, progress=not args.no_progress,
                         stem=args.stem, max_wait_s=args.wait_quiet)
    after = [matmul_gflops(*s, dtype=args.dtype) for s in shapes]
    peak = max(x["best_gflops"] for x in before + after)
    decode_peak = max(before[2]["best_gflops"], after[2]["best_gflops"])
    fl = {}
    for name, r in doc["systems"].items():
        if not r.get("wall_s"):
            continue
        mf = model_flops(hf_cfg, r["prompt_tokens_computed"], r["output_tokens"], args.num_requests)
        achieved = mf["flops_matmul"] / r["wall_s"] / 1e9
        fl[name] = dict(mf, achieved_gflops=round(achieved, 2),
                        achieved_gflops_simple=round(mf["flops_simple"] / r["wall_s"] / 1e9, 2),
                        fraction_of_peak=round(achieved / peak, 4),
                        fraction_of_decode_shape_matmul=round(achieved / decode_peak, 4))
    doc.update(matmul_before=before, matmul_after=after, peak_gflops=peak, decode_shape_gflops=decode_peak,
               model_flops=fl)
    jp = rewrite_result(doc)
    print(table(doc))
    print(ratio_table(doc))
    print("\nmatmul GFLOP/s (best of ~1 s) before / after:")
    for b, a in zip(before, after):
        print(f"  {b['shape']}: {b['best_gflops']} / {a['best_gflops']}  (median {b['median_gflops']} / {a['median_gflops']})")
    for name, f in fl.items():
        print(f"{name}: {f['achieved_gflops']} GFLOP/s of model matmuls = {f['fraction_of_peak']:.1%} of the "
              f"{peak} GFLOP/s peak, {f['fraction_of_decode_shape_matmul']:.1%} of a decode-shaped matmul")
    print(f"wrote {jp}")
    return 0


# ---------------------------------------------------------------------------------------- roofline
def read_bandwidth_gbs(num_bytes: int = 1 << 30, seconds: float = 2.0) -> dict:
    """Streaming read bandwidth of this machine (all torch threads): a float32 sum over a buffer
    far larger than the caches, best and median of repeated passes."""
    import torch

    x = torch.ones(num_bytes // 4)
    x.sum()
    rates = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(rates) < 3:
        t0 = time.perf_counter()
        x.sum()
        rates.append(num_bytes / (time.perf_counter() - t0) / 1e9)
    return dict(bytes=num_bytes, best_gbs=round(max(rates), 2), median_gbs=round(statistics.median(rates), 2))


def gemm_peak_gflops(m: int, k: int, n: int, seconds: float = 1.0) -> dict:
    """fp32 GEMM peak of this machine: the better of oneDNN on a prepacked weight and the engine's
    C GEMM (where built), at a compute-bound shape."""
    from prefixkv import cpu_ops

    kinds = ["onednn"] + (["c"] if cpu_ops.gemm_available() else [])
    runs = {kind: _gemm_gflops(kind, m, k, n, seconds) for kind in kinds}
    best = max(runs, key=lambda kind: runs[kind]["best_gflops"])
    return dict(runs[best], backend=best, by_backend=runs)


def _gemm_gflops(kind: str, m: int, k: int, n: int, seconds: float) -> dict:
    import torch

    from prefixkv.model.linear import Linear

    lin = Linear(k, n)
    lin.weight = torch.nn.Parameter(torch.randn(n, k), requires_grad=False)
    lin.prepack(kind)
    x = torch.randn(m, k)
    for _ in range(3):
        lin(x)
    rates = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(rates) < 5:
        t0 = time.perf_counter()
        lin(x)
        rates.append(2 * m * k * n / (time.perf_counter() - t0) / 1e9)
    return dict(shape=[m, k, n], best_gflops=round(max(rates), 2), median_gflops=round(statistics.median(rates), 2))


def cmd_roofline(args: argparse.Namespace, command: str) -> int:
    """A prefixkv decode step at batch B against the machine's roofline: the larger of (weights +
    KV bytes read per step / measured read bandwidth) and (FLOPs per step / measured fp32 GEMM
    peak). The decode step is timed in the shared-prefix state (B requests, S shared tokens, each
    with its own Q tokens, prefilled). On a shared machine the bandwidth moves by up to 1.6x within
    minutes, so the run is ``--rounds`` rounds, each measuring the read bandwidth and the GEMM peak
    right before its ``--steps`` decode steps: a round's ratio is its median step over the roofline
    of its own figures, and the median round is the result. The whole-run ratio (the best
    bandwidth and peak of any round against the median of all steps) is reported beside it."""
    import torch

    from prefixkv import LLM, SamplingParams
    from prefixkv.model.loader import load_hf_config, resolve_model

    path = resolve_model(args.model)
    cfg = load_hf_config(path)
    llm = LLM(model=args.model, block_size=args.block_size, num_kv_blocks=max(1, args.kv_tokens // args.block_size),
              max_num_seqs=max(64, args.batch), max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.engine
    v = eng.info.vocab_size - 10
    shared = [3 + (i * 7919) % v for i in range(args.system_tokens)]
    for i in range(args.batch):
        own = [3 + (i * 104729 + k * 31) % v for k in range(args.question_tokens)]
        eng.add_request(f"r{i}", shared + own, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    m = eng.runner.model
    packed = [mod.packed for mod in m.modules() if getattr(mod, "packed", None) is not None]
    weight_bytes = 0
    for mod in m.modules():
        w = getattr(mod, "weight", None)
        if getattr(mod, "packed", None) is not None:
            weight_bytes += mod.in_features * mod.out_features * 4
        elif isinstance(w, torch.Tensor) and mod is not m.model.embed_tokens:
            weight_bytes += w.numel() * w.element_size()
    s = m.shape
    kv_bytes_per_token = s.num_layers * 2 * s.num_kv_heads * s.head_dim * 4

    def figures(times: list[float], contexts: list[float], bw: dict, peak: dict) -> dict:
        """The roofline of these steps' mean context at this bandwidth and peak, and the steps against it."""
        ctx, step = statistics.fmean(contexts), statistics.median(times)
        # every sequence reads its whole context (the shared prefix too: the kernel reads per sequence)
        kv_bytes = int(args.batch * ctx * kv_bytes_per_token)
        flops = 2 * args.batch * (weight_bytes // 4) + 4 * args.batch * ctx * s.num_layers * s.num_heads * s.head_dim
        t_mem, t_flop = (weight_bytes + kv_bytes) / (bw["best_gbs"] * 1e9), flops / (peak["best_gflops"] * 1e9)
        roof = max(t_mem, t_flop)
        return dict(mean_context_tokens=round(ctx, 1), read_bandwidth=bw, gemm_peak=peak, kv_bytes_per_step=kv_bytes,
                    flops_per_step=flops, roofline_memory_ms=round(t_mem * 1e3, 2),
                    roofline_compute_ms=round(t_flop * 1e3, 2), roofline_ms=round(roof * 1e3, 2),
                    decode_step_ms_median=round(step * 1e3, 2), decode_step_ms_best=round(min(times) * 1e3, 2),
                    step_over_roofline=round(step / roof, 3))

    rounds, all_times, all_contexts = [], [], []
    for _ in range(max(1, args.rounds)):
        bw = read_bandwidth_gbs(seconds=1.0)
        peak = gemm_peak_gflops(512, cfg.hidden_size, cfg.intermediate_size, seconds=0.5)
        times, contexts = [], []
        for _ in range(args.steps):
            contexts.append(sum(r.num_tokens for r in eng.scheduler.running) / len(eng.scheduler.running))
            t0 = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t0)
        rounds.append(figures(times, contexts, bw, peak))
        all_times += times
        all_contexts += contexts
    mid = sorted(rounds, key=lambda r: r["step_over_roofline"])[len(rounds) // 2]
    # the whole run: the best figures any round measured, the median of every step
    best_bw = max((r["read_bandwidth"] for r in rounds), key=lambda b: b["best_gbs"])
    best_peak = max((r["gemm_peak"] for r in rounds), key=lambda g: g["best_gflops"])
    doc = dict(command=command, batch=args.batch, rounds=len(rounds), steps_per_round=args.steps,
               step_over_roofline_median_round=mid["step_over_roofline"],
               roofline_ms_median_round=mid["roofline_ms"], decode_step_ms_median_round=mid["decode_step_ms_median"],
               weight_bytes=weight_bytes, **figures(all_times, all_contexts, best_bw, best_peak),
               num_packed_gemms=len(packed), by_round=rounds)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jp = out / f"{args.stem or 'roofline'}.json"
    jp.write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: v for k, v in doc.items() if k not in ("command", "by_round")}, indent=2))
    for i, r in enumerate(rounds):
        print(f"round {i}: read {r['read_bandwidth']['best_gbs']} GB/s, GEMM peak {r['gemm_peak']['best_gflops']} "
              f"GFLOP/s ({r['gemm_peak']['backend']}): roofline {r['roofline_ms']} ms; decode step "
              f"{r['decode_step_ms_median']} ms = {r['step_over_roofline']}x")
    print(f"median round: decode step {mid['decode_step_ms_median']} ms = {mid['step_over_roofline']}x its roofline "
          f"of {mid['roofline_ms']} ms")
    print(f"whole run: decode step {doc['decode_step_ms_median']} ms (median) = {doc['step_over_roofline']}x the "
          f"roofline of {doc['roofline_ms']} ms (best bandwidth and peak of any round: memory "
          f"{doc['roofline_memory_ms']} ms, compute {doc['roofline_compute_ms']} ms)")
    print(f"wrote {jp}")
    return 0


# ---------------------------------------------------------------------------------------- scale
def scale_step_cost(num_running: int, num_cached_blocks: int, context_tokens: int, steps: int,
                    block_size: int = 16, num_waiting: int = 128, waiting_tokens: int = 8192) -> dict:
    """Host time of an engine step at GPU scale, without a model: ``num_running`` decoding requests
    of ``context_tokens`` each (their blocks in the radix index), ``num_cached_blocks`` more cached
    (evictable) blocks, no free block (each completed decode block evicts one), and
    ``num_waiting`` long prompts that cannot be admitted (admission pressure). Times
    ``LLMEngine.step`` with a runner whose forward pass and sampler are fake (scheduler, KV
    bookkeeping, the real ``ModelRunner.prepare`` of the batch's host tensors, update, output
    processing), and ``prepare`` alone inside it. The first step (it hands the runner every
    table whole) is not counted."""
    import torch

    from prefixkv.config import CacheConfig, SchedulerConfig
    from prefixkv.engine import LLMEngine, StepCounters
    from prefixkv.output_processor import OutputProcessor, RequestState
    from prefixkv.request import Request, RequestStatus
    from prefixkv.runner.block_table import BlockTables
    from prefixkv.runner.model_runner import ModelOutput, ModelRunner
    from prefixkv.sampling_params import SamplingParams
    from prefixkv.scheduler import Scheduler

    bs = block_size
    blocks_per_req = -(-(context_tokens + steps + 1) // bs)
    num_blocks = num_running * blocks_per_req + num_cached_blocks
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=max(2048, 2 * num_running), max_num_seqs=num_running,
                                      max_waiting_requests=num_waiting + 1),
                      CacheConfig(block_size=bs, num_kv_blocks=num_blocks), num_blocks)
    kv = sched.kv
    t_setup = time.perf_counter()
    # cached prefixes: distinct 64-block prompts, computed and released (evictable)
    prefix_blocks = 64
    for i in range(num_cached_blocks // prefix_blocks):
        toks = [(i * 7 + k) % 251 for k in range(prefix_blocks * bs)]
        toks[0], toks[1] = 1000 + i // 251, i % 251
        sid = f"c{i}"
        kv.allocate_slots(sid, 0, len(toks))
        kv.cache_blocks(sid, toks, len(toks))
        kv.free(sid)
    # running requests in decode: context_tokens computed, their full blocks in the tree
    params = SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True, output_kind="delta")
    parents = {}
    for i in range(num_running):
        toks = [(i * 13 + k * 7) % 251 for k in range(context_tokens)]
        toks[0], toks[1] = 2000 + i // 251, i % 251
        req = Request(f"r{i}", toks, params, i, 0)
        kv.allocate_slots(req.seq_id, 0, context_tokens)
        kv.cache_blocks(req.seq_id, toks, context_tokens - 1)
        req.num_computed_tokens = context_tokens - 1
        req.status = RequestStatus.RUNNING
        sched.running.append(req)
        sched.requests[req.seq_id] = req
        parent = RequestState(req.request_id, None, array("q", toks), params)
        parent.seqs[0] = req
        parents[req.request_id] = parent
    while kv.pool.num_free:  # no free block: decode growth must evict cached prefixes
        sid = f"pad{kv.pool.num_free}"
        kv.allocate_slots(sid, 0, bs)
    for i in range(num_waiting):
        toks = [3000 + i] + [(i + k) % 251 for k in range(waiting_tokens - 1)]
        sched.add_request(Request(f"w{i}", toks, SamplingParams(max_tokens=4), num_running + i, 0))
    setup_s = time.perf_counter() - t_setup

    # an engine around this scheduler: the real step loop and output processing, a fake runner
    eng = LLMEngine.__new__(LLMEngine)
    eng.config = SimpleNamespace(scheduler=sched.config)
    eng.scheduler = sched
    eng._parents = {**parents, **{r.request_id: RequestState(r.request_id, None, r.prompt_token_ids, r.sampling_params,
                                                            seqs={0: r}) for r in sched.waiting}}
    eng.output = OutputProcessor(_FakeTokenizer(), [], 1 << 30)
    eng.check_integrity_each_step = False
    eng.num_steps = 0
    eng.step_counters = StepCounters()
    eng.kv_events = None  # (no KV events: the step publishes none)
    eng.dead = None
    for parent in eng._parents.values():  # detokenize=False requests: no text work
        parent.params.detokenize = False
    prep_runner = SimpleNamespace(block_size=bs, device=torch.device("cpu"), max_model_len=1 << 30,
                                  block_tables=[BlockTables(blocks_per_req, num_running)])
    prep = []

    def execute(out):
        t = time.perf_counter()
        ModelRunner.prepare(prep_runner, out)
        prep.append(time.perf_counter() - t)
        return ModelOutput(_fake_sampled(out), [None] * len(out.scheduled))

    eng.runner = SimpleNamespace(execute=execute)
    evict_calls = []
    real_evict = kv._evict

    def counting_evict(n, save=True):
        evict_calls.append(n)
        return real_evict(n, save)

    kv._evict = counting_evict
    eng.step()  # hands the runner every table whole (not counted)
    del prep[:], evict_calls[:]
    host = []
    v0, w0 = kv.radix.num_visits, prep_runner.block_tables[0].num_entries_written
    full_gcs = []  # ms of each full (oldest-generation) collection during the counted steps
    gc_start = [0.0]

    def on_gc(phase, info):
        if info["generation"] == 2:
            if phase == "start":
                gc_start[0] = time.perf_counter()
            else:
                full_gcs.append((time.perf_counter() - gc_start[0]) * 1e3)

    gc.callbacks.append(on_gc)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            outs = eng.step()
            host.append(time.perf_counter() - t0)
            assert len(outs) == num_running, len(outs)
    finally:
        gc.callbacks.remove(on_gc)
    assert sched.num_waiting == num_waiting  # admission never succeeded: every step had pressure
    return dict(num_running=num_running, num_cached_blocks=num_cached_blocks, num_pool_blocks=num_blocks,
                context_tokens=context_tokens, num_waiting=num_waiting, waiting_tokens=waiting_tokens,
                setup_s=round(setup_s, 1), host_step_ms_median=round(statistics.median(host) * 1e3, 3),
                host_step_ms_max=round(max(host) * 1e3, 3), host_step_ms_mean=round(statistics.fmean(host) * 1e3, 3),
                full_gc_count=len(full_gcs), full_gc_ms=[round(x, 1) for x in full_gcs],
                prepare_ms_median=round(statistics.median(prep) * 1e3, 3),
                evictions=sum(evict_calls), radix_visits_per_step=round((kv.radix.num_visits - v0) / steps, 1),
                table_entries_written_per_step=round((prep_runner.block_tables[0].num_entries_written - w0) / steps, 1))


class _FakeTokenizer:
    eos_token_ids = [2]

    def decode(self, ids, skip_special_tokens=True):
        return ""

    def token_text(self, token_id, skip_special_tokens=True):
        return ""


def cmd_scale(args: argparse.Namespace, command: str) -> int:
    import prefixkv.engine  # noqa: F401 - torch, transformers and the engine's modules, as in a server
    from prefixkv.engine_core.process import tune_gc_for_serving

    tune_gc_for_serving()  # what `prefixkv serve` does once it has started
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        for c in [int(float(x)) for x in args.cached_blocks.split(",")]:
            r = scale_step_cost(n, c, args.context_tokens, args.steps, args.block_size)
            rows.append(r)
            print(f"{n:>5} running, {c:>8} cached blocks, {args.context_tokens} ctx: host step "
                  f"{r['host_step_ms_median']:.3f} ms (mean {r['host_step_ms_mean']:.3f}, max {r['host_step_ms_max']:.3f}; "
                  f"full GCs {r['full_gc_ms']} ms), of which runner.prepare "
                  f"{r['prepare_ms_median']:.3f} ms, {r['evictions']} blocks evicted, "
                  f"{r['table_entries_written_per_step']} block-table entries written/step, "
                  f"{r['radix_visits_per_step']} radix visits/step (setup {r['setup_s']} s)", flush=True)
    doc = dict(workload="scale", command=command, machine=machine_info(args.threads), results=rows)
    path = write_result(doc, args.out, args.stem or f"scale-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"wrote {path}")
    return 0


# ---------------------------------------------------------------------------------------- gemm
def cmd_gemm(args: argparse.Namespace, command: str) -> int:
    """The model's projections, every layer's own weights (so they stream from memory as in a
    step), through F.linear (MKL sgemm), the engine's C GEMM on packed weights (its CPU default),
    oneDNN on prepacked weights and MKL's packed GEMM, at several row counts: ms per pass over the
    layer stack, GB/s of weights. The paths take turns, one pass each, ``--repeat-passes`` rounds
    (medians). ``--c-baseline FILE``: another version of prefixkv/csrc/cpu_ops.c (e.g. ``git show
    REV:prefixkv/csrc/cpu_ops.c``), built with the same flags, runs beside the current one as
    "c-baseline", and whether the two give the same bits at every row count is reported."""
    import torch
    import torch.nn.functional as F

    from prefixkv import cpu_ops
    from prefixkv.model.loader import load_hf_config, resolve_model

    cfg = load_hf_config(resolve_model(args.model))
    h, inter = cfg.hidden_size, cfg.intermediate_size
    nh = cfg.num_attention_heads
    kvh = getattr(cfg, "num_key_value_heads", nh) or nh
    d = getattr(cfg, "head_dim", None) or h // nh
    shapes = [((nh + 2 * kvh) * d, h), (h, nh * d), (2 * inter, h), (h, inter)]  # fused qkv, o, gate_up, down
    g = torch.Generator().manual_seed(0)
    weights = [[torch.randn(n, k, generator=g) * 0.02 for n, k in shapes] for _ in range(cfg.num_hidden_layers)]
    nbytes = sum(w.numel() * 4 for ws in weights for w in ws)
    mk = torch.ops.mkldnn
    baseline = cpu_ops.load_source(Path(args.c_baseline)) if args.c_baseline else None
    if baseline is not None and baseline.vector_bits == 0:
        raise SystemExit(f"--c-baseline: {args.c_baseline} has no GEMM for this CPU")
    rows = []
    for m in [int(x) for x in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in shapes}}
        dnn = [[mk._reorder_linear_weight(w, 16) for w in ws] for ws in weights]
        c_calls = [[cpu_ops.gemm_caller(cpu_ops.gemm_pack(w), w.shape[0]) for w in ws] for ws in weights] \
            if cpu_ops.gemm_available() else None
        mkl = [[torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws] for ws in weights]
        paths = {
            "F.linear": lambda: [F.linear(xs[w.shape[1]], w) for ws in weights for w in ws],
            "onednn-prepacked": lambda: [mk._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                         for ws, ps in zip(weights, dnn) for w, p in zip(ws, ps)],
            "mkl-packed": lambda: [torch.ops.mkl._mkl_linear(xs[w.shape[1]], p, w, None, m)
                                   for ws, ps in zip(weights, mkl) for w, p in zip(ws, ps)],
        }
        if c_calls is not None:
            paths["c-packed"] = lambda: [c(xs[w.shape[1]]) for ws, cs in zip(weights, c_calls) for w, c in zip(ws, cs)]
        if baseline is not None:
            b_calls = [[cpu_ops.gemm_caller(cpu_ops.gemm_pack(w, baseline), w.shape[0], lib=baseline) for w in ws]
                       for ws in weights]
            paths["c-baseline"] = lambda: [c(xs[w.shape[1]]) for ws, cs in zip(weights, b_calls) for w, c in zip(ws, cs)]
        res = dict(rows=m)
        outs = {name: fn() for name, fn in paths.items()}  # warm; kept for the bitwise check
        if baseline is not None and c_calls is not None:
            res["c_baseline_bitwise_equal"] = all(torch.equal(a, b) for a, b in zip(outs["c-packed"], outs["c-baseline"]))
        del outs
        times = {name: [] for name in paths}
        for _ in range(args.repeat_passes):
            for name, fn in paths.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for name, ts in times.items():
            t = statistics.median(ts)
            res[name] = dict(ms=round(t * 1e3, 2), weight_gbs=round(nbytes / t / 1e9, 2),
                             gflops=round(2 * m * nbytes / 4 / t / 1e9, 1))
        rows.append(res)
        print(f"M={m:>4}: " + "  ".join(f"{k} {v['ms']} ms ({v['weight_gbs']} GB/s, {v['gflops']} GFLOP/s)"
                                        for k, v in res.items() if isinstance(v, dict))
              + (f"  bitwise equal to c-baseline: {res['c_baseline_bitwise_equal']}"
                 if "c_baseline_bitwise_equal" in res else ""), flush=True)
    doc = dict(workload="gemm", command=command, weight_bytes=nbytes, shapes=shapes, c_baseline=args.c_baseline,
               num_layers=cfg.num_hidden_layers, machine=machine_info(args.threads), results=rows)
    path = write_result(doc, args.out, args.stem or f"gemm-{time.strftime('%Y%m%d-%H%M%S')}")
    print(f"wrote {path}")
    return 0
