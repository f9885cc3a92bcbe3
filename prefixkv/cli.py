"""``prefixkv serve | generate | bench``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefixkv.engine_args import add_engine_args, engine_config_from_args  # noqa: F401 (re-exported)
from prefixkv.serve.app import add_ray_args


def cmd_generate(args: argparse.Namespace) -> int:
    from prefixkv.engine import LLMEngine
    from prefixkv.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed_sampling, stop=args.stop or None)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
    engine.add_request("cli", prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.outputs[0].delta_text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _bench(argv: list[str]) -> int:
    try:
        from bench.__main__ import main as bench_main
    except ModuleNotFoundError:  # an editable install run outside the checkout
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from bench.__main__ import main as bench_main
    return bench_main(argv) or 0


QUIET_HELP = ("no progress bars or progress lines while the model is converted, the kernels built, the weights "
              "loaded (sets PREFIXKV_QUIET=1, also for Ray replicas)")


def default_model_name(model: str | None) -> str:
    if model is None:
        from prefixkv.model.loader import EMBEDDED_NAME

        return EMBEDDED_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.name


def server_config_from_args(args: argparse.Namespace):
    from prefixkv.server.serving import ServerConfig

    keys = list(args.api_key or []) or [k for k in [os.environ.get("PREFIXKV_API_KEY")] if k]
    if args.api_keys_file is not None:
        keys += read_keys_file(args.api_keys_file)
    return ServerConfig(model_name=args.served_model_name or default_model_name(args.model),
                        api_key=keys[0] if keys else None, api_keys=tuple(keys[1:]),
                        cache_isolation=args.cache_isolation,
                        max_body_bytes=args.max_body_bytes, request_timeout=args.request_timeout,
                        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser, max_stored_responses=args.max_stored_responses,
                        max_stored_response_bytes=args.max_stored_response_bytes,
                        cache_view_text=args.cache_view_text,
                        enable_reset_prefix_cache=args.enable_reset_prefix_cache)


def read_keys_file(path: str) -> list[str]:
    """API keys, one a line (blank lines and lines starting with '#' skipped)."""
    lines = Path(path).read_text().splitlines()
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"api_keys_file: {path} holds no key")
    return keys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixkv", description="lossless LLM inference engine")
    sub = parser.add_subparsers(dest="cmd", required=True)

    gen = sub.add_parser("generate", help="print the completion of one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed-sampling", type=int, default=None)
    gen.add_argument("--stop", action="append")
    gen.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    add_engine_args(gen)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", action="append", default=None,
                       help="require 'Authorization: Bearer KEY' (or set PREFIXKV_API_KEY); give it again for more "
                            "keys, any of which is accepted")
    serve.add_argument("--api-keys-file", default=None,
                       help="more API keys, one a line ('#' starts a comment line)")
    serve.add_argument("--cache-isolation", choices=("none", "api-key"), default="none",
                       help="api-key: requests share prefix-cache blocks (device, host, disk, routing) only with "
                            "requests authenticated by the same API key; a request's cache_salt then subdivides "
                            "its key's partition (README: Tenants)")
    serve.add_argument("--served-model-name", default=None)
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20)
    serve.add_argument("--request-timeout", type=float, default=600.0, help="seconds before a request is aborted")
    serve.add_argument("--cache-view-text", action="store_true",
                       help="let the /cache page (GET /v1/cache/summary) show the start of each cached run's text; "
                            "off by default: the cache view then shows token counts only, never prompt text")
    serve.add_argument("--enable-reset-prefix-cache", action="store_true",
                       help="serve POST /reset_prefix_cache (vLLM's): every cached block dropped, in every tier, "
                            "while no request runs (with --replicas: on every replica); behind the API key, but any "
                            "key may then empty every tenant's cache (off by default: 403)")
    serve.add_argument("--tool-call-parser", choices=("auto", "hermes", "llama3_json", "none"), default="auto",
                       help="parse tool calls out of free replies, for tool_choice 'auto' (server/tools.py); auto "
                            "(the default): the parser for the chat template's tool format, if recognised (logged at "
                            "start-up); none: tool_choice 'auto' is refused")
    serve.add_argument("--max-stored-responses", type=int, default=1000,
                       help="POST /v1/responses with store: at most this many responses kept for previous_response_id "
                            "and GET (least recently used dropped first)")
    serve.add_argument("--max-stored-response-bytes", type=int, default=64 << 20,
                       help="... and at most this many bytes of their JSON (response and conversation)")
    serve.add_argument("--reasoning-parser", choices=("qwen3", "deepseek_r1"), default=None,
                       help="split <think> ... </think> out of replies: reasoning_content (chat), reasoning items "
                            "(Responses), thinking blocks (Messages) (server/reasoning.py)")
    serve.add_argument("-q", "--quiet", action="store_true", help=QUIET_HELP)
    serve.add_argument("--api-server-count", type=int, default=1,
                       help="HTTP processes sharing the port, each over the one engine-core process (they parse, "
                            "tokenize, detokenize and stream; the engine steps in its own process)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="step the engine in its own process (default); --no-engine-process: in a thread of "
                            "the HTTP process, as before (one process)")
    serve.add_argument("--engine-threads", type=int, default=None,
                       help="compute threads of the engine process (default: every CPU up to 4, beyond that one "
                            "CPU per HTTP process is left out: prefixkv/engine_core/process.py)")
    add_engine_args(serve)
    add_ray_args(serve)

    bench = sub.add_parser("bench", help="benchmarks (see bench/)", add_help=False)
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def uses_ray(args: argparse.Namespace) -> bool:
    """``serve`` with any of the replica flags runs on Ray Serve."""
    return (args.replicas is not None or args.ray_address is not None or args.min_replicas is not None
            or args.max_replicas is not None or args.target_ongoing_requests is not None
            or args.autoscaling_config is not None)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # everything after `bench` is the benchmark's own command line
        return _bench(argv[1:])
    args = parser.parse_args(argv)
    if args.quiet:  # read by prefixkv/progress.py, in this process and the ones it starts
        os.environ["PREFIXKV_QUIET"] = "1"
    try:
        if args.cmd == "generate":
            return cmd_generate(args)
        if args.cmd == "serve" and uses_ray(args):
            from prefixkv.serve.app import run_ray_server

            return run_ray_server(args, engine_config_from_args(args), server_config_from_args(args))
        if args.cmd == "serve":
            from prefixkv.server.app import run_server

            return run_server(engine_config_from_args(args), server_config_from_args(args), args.host, args.port,
                              api_server_count=args.api_server_count, engine_process=args.engine_process,
                              engine_threads=args.engine_threads)
    except (ValueError, FileNotFoundError) as e:
        print(f"prefixkv: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
