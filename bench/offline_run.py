"""One ``LLM.generate`` of token-id prompts in a process of its own, started with the environment the
engine-core process gets (``engine_core.process.engine_environment``: how its OpenMP threads wait),
so that offline and served runs of the same engine compare like with like::

    python -m bench.offline_run < spec.json
        -> {"elapsed_s": ..., "cpu_s": ..., "num_output_tokens": ..., "engine_steps": ...}

``engine_steps``: what the engine's steps took during the run (``prefixkv.engine.StepCounters``);
``cpu_s``: the CPU seconds of the process (every thread) during it.

spec: {"model", "prompts": [[ids]], "output_tokens", "max_num_seqs", "kv_cache_bytes", "threads"}, and
optionally "max_wait_steps" (the engine's; None or absent: its default) and "before": [[[ids]]], lists
of prompts generated (``output_tokens`` each) before the timed run, the prefix cache kept, and
"block_pool": another version of prefixkv/kv/block_pool.py whose ``BlockPool`` the engine uses
(``bench aged-engine --baseline-pool``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def run(spec: dict) -> dict:
    """``spec`` in a fresh interpreter (see the module docstring)."""
    from prefixkv.engine_core.process import engine_environment

    env = {**os.environ, **engine_environment(), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run([sys.executable, "-m", "bench.offline_run"], input=json.dumps(spec), capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"offline run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    spec = json.loads(sys.stdin.read())
    import torch

    from prefixkv import LLM, SamplingParams

    torch.set_num_threads(spec["threads"])
    if spec.get("block_pool"):
        import importlib.util

        from prefixkv.kv import coordinator

        found = importlib.util.spec_from_file_location("baseline_block_pool", spec["block_pool"])
        module = importlib.util.module_from_spec(found)
        found.loader.exec_module(module)
        coordinator.BlockPool = module.BlockPool
    scheduler = {} if spec.get("max_wait_steps") is None else {"max_wait_steps": spec["max_wait_steps"]}
    llm = LLM(model=spec["model"], dtype="float32", max_num_seqs=spec["max_num_seqs"],
              kv_cache_memory_bytes=spec["kv_cache_bytes"], max_waiting_requests=100_000, **scheduler)
    prompts = spec["prompts"]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm
    llm.engine.scheduler.kv.reset_cache()
    sp = SamplingParams(max_tokens=spec["output_tokens"], temperature=0.0, ignore_eos=True)
    for prompts_before in spec.get("before", ()):
        llm.generate(prompts_before, sp)
    before = llm.engine.step_counters.stats()
    t0, cpu0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, sp)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    after = llm.engine.step_counters.stats()
    print(json.dumps({"elapsed_s": elapsed, "cpu_s": cpu,
                      "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                      "engine_steps": {k: after[k] - before[k] for k in after}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
