"""torch.profiler table of prefixkv decode steps in the shared-prefix state, the counterpart of
vLLM's own profiler run (``bench/vllm_worker.py --profile``)::

    python -m bench.profile_step [--batch 16] [--system-tokens 196] [--question-tokens 32] [--steps 10]

B requests share an S-token prefix, each with its own Q tokens; after their prefill, ``--steps``
decode steps run under the profiler. The C kernels (called through ctypes) do not show as ops, so
they are timed apart over the same number of unprofiled steps (their wrappers in prefixkv.cpu_ops)."""

from __future__ import annotations

import argparse
import collections
import time


def time_kernels(eng) -> dict[str, float]:
    """Wrap ``eng``'s C kernels with timers: returns the dict each call adds its seconds to, by kernel
    (``gemm`` for every packed Linear). The layers run as a Python loop from then on (the one-call
    driver of model/fused_stack.py calls the kernels inside C, out of these wrappers' sight)."""
    from prefixkv import cpu_ops
    from prefixkv.model.linear import Linear

    spent: dict[str, float] = collections.defaultdict(float)
    eng.runner.model.fused_stack_blocker = "bench.profile_step: the kernels timed one by one"
    for mod in eng.runner.model.modules():  # the C GEMM: each packed Linear's bound call
        if isinstance(mod, Linear) and mod.kind == "c":
            def timed_gemm(x, _fn=mod.c_gemm):
                t = time.perf_counter()
                try:
                    return _fn(x)
                finally:
                    spent["gemm"] += time.perf_counter() - t

            mod.c_gemm = timed_gemm
    for name in ("paged_decode_attention", "paged_prefill_attention", "add_rmsnorm", "rope_", "silu_mul"):
        fn = getattr(cpu_ops, name)

        def timed(*args, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*args, **kw)
            finally:
                spent[_name] += time.perf_counter() - t

        setattr(cpu_ops, name, timed)
    return spent


def shared_prefix_decodes(eng, batch: int = 16, system_tokens: int = 196, question_tokens: int = 32) -> None:
    """``batch`` greedy requests sharing a ``system_tokens`` prefix, each with its own
    ``question_tokens``, added to ``eng`` and prefilled: its next steps are decode steps. ``eng``'s
    ``max_num_seqs`` must be at least ``batch`` (the requests never finish, so the rest would wait forever)."""
    from prefixkv import SamplingParams

    bound = eng.config.scheduler.max_num_seqs
    if batch > bound:
        raise ValueError(f"batch: {batch} decodes at once need max_num_seqs >= {batch} (the engine's is {bound})")

    v = min(40000, eng.info.vocab_size - 5)  # (token ids of SmolLM2's vocabulary; of a tiny one in tests)
    shared = [3 + (i * 7919) % v for i in range(system_tokens)]
    for i in range(batch):
        eng.add_request(f"r{i}", shared + [5 + (i * 31 + k) % v for k in range(question_tokens)],
                        SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    while eng.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()


def main(argv: list[str] | None = None) -> int:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from prefixkv import LLM

    p = argparse.ArgumentParser(prog="python -m bench.profile_step")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=196)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="also write the table to this file")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    llm = LLM(max_num_seqs=max(64, a.batch))
    eng = llm.engine
    shared_prefix_decodes(eng, a.batch, a.system_tokens, a.question_tokens)
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    times.sort()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        profiled = (time.perf_counter() - t0) / a.steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    fused = eng.runner.model.fused_stack_blocker == ""
    spent = time_kernels(eng)
    t0 = time.perf_counter()
    for _ in range(a.steps):
        eng.step()
    plain = (time.perf_counter() - t0) / a.steps
    kernels = "".join(f"  {k}: {v / a.steps * 1e3:.2f} ms per step\n" for k, v in sorted(spent.items(), key=lambda x: -x[1]))
    table += (f"\nC kernels (ctypes; timed over {a.steps} unprofiled steps of {plain * 1e3:.2f} ms"
              f"{', the layers as a Python loop' if fused else ''}):\n" + kernels)
    head = (f"prefixkv decode step, batch {a.batch}, {a.system_tokens} shared + {a.question_tokens} own tokens"
            f"{' (the layers in one C call)' if fused else ''}: "
            f"{times[len(times) // 2] * 1e3:.2f} ms median of 20 unprofiled steps (min {times[0] * 1e3:.2f}); "
            f"{profiled * 1e3:.2f} ms per profiled step ({a.steps} steps below)\n")
    print(head + table)
    if a.out:
        with open(a.out, "w") as f:
            f.write(head + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
