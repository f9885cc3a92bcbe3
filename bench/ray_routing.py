"""``python -m bench ray-routing``: multi-tenant shared-prefix traffic across engine replicas on
Ray Serve, one run per request router, same traffic, same command.

Traffic: ``--groups`` system prompts of ``--system-tokens`` tokens, ``--users`` requests each (own
question, ``--output-tokens`` greedy tokens), interleaved in one shuffled order with Poisson arrivals
at ``--rate`` requests/s (``bench serving``'s prompts, client and statistics). Each replica's KV pool
is ``--num-kv-blocks`` blocks: by default half of the system prompts fit in one replica, with room to
compute one whole prompt beside them.

For every router in ``--routers`` (power_of_two: Serve's default; prefix_affinity: Ray Serve LLM's
``PrefixCacheAffinityRouter``; cache_aware: prefixkv's, on the replicas' cache digests) a fresh
application (new replicas, cold caches) serves the whole traffic through the ingress's
/v1/completions (token ids); reported: prefix-cache hit fraction (the client's usage), TTFT
p50/p90/p99, output tokens/s and requests/s over the run, and each router's ratios against
power_of_two. One local Ray instance with ``--cpus`` CPUs; each replica gets
``--num-cpus-per-replica`` of them (OpenMP threads follow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from bench import workloads as wl
from bench.corpus import TokenStream
from bench.serving import build_prompts, request_body, run_rate, summarize

ROUTERS = ("power_of_two", "prefix_affinity", "cache_aware")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--users", type=int, default=12, help="requests per system prompt")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.5, help="requests/s (Poisson)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="per replica (default: half the system prompts' blocks plus room for 8 requests)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--routing-stats-period", type=float, default=1.0)
    p.add_argument("--router-imbalanced-threshold", type=int, default=None,
                   help="cache_aware's (default: its own, serve/router.py)")
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--max-seconds", type=float, default=3600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=1)


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_up(base: str, replicas: int, timeout: float) -> None:
    import aiohttp

    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < end:
            try:
                async with session.get(base + "/health") as r:
                    if r.status == 200 and len((await r.json()).get("replicas", {})) >= replicas:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"bench ray-routing: the application did not come up within {timeout:g} s")


async def _drive(base: str, bodies: list, args: argparse.Namespace) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        run = await run_rate(session, base, "/v1/completions", bodies, args.rate, args, {})
        async with session.get(base + "/metrics") as r:
            metrics_text = await r.text()
    doc = summarize(run)
    doc["router_metrics"] = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                             for line in metrics_text.splitlines()
                             if line.startswith(("prefixkv_router_decisions_total", "prefixkv_replica_routed",
                                                 "prefixkv_replica_prefix_cache_hit_tokens_total"))}
    return doc


def cmd_ray_routing(args: argparse.Namespace, command: str) -> int:
    import ray
    from ray import serve

    from bench.cli_impl import load_tokenizer
    from bench.run import machine_info
    from prefixkv.engine_args import EngineArgs
    from prefixkv.serve import build_app
    from prefixkv.server.serving import ServerConfig

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    bad = [r for r in routers if r not in ROUTERS]
    if bad:
        raise SystemExit(f"bench ray-routing: --routers: unknown {bad}; choose from {', '.join(ROUTERS)}")
    _, tok = load_tokenizer(args.model)
    pb = wl.PromptBuilder(tok, TokenStream.build(tok))
    prompts = build_prompts(pb, args.groups, args.groups * args.users, args.system_tokens, args.question_tokens,
                            args.seed)
    bodies = [(p, request_body(pb, p, "completions", args.output_tokens)) for p in prompts]
    bs = args.block_size
    per_prompt = -(-(args.system_tokens + args.question_tokens + args.output_tokens) // bs)
    # half the system prompts, and room to compute one request's whole prompt beside them
    num_blocks = args.num_kv_blocks or (args.groups // 2) * -(-args.system_tokens // bs) + per_prompt
    cfg = EngineArgs(model=args.model, dtype=args.dtype, block_size=bs, num_kv_blocks=num_blocks,
                     max_num_seqs=args.max_num_seqs).create_engine_config()
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    runs = {}
    try:
        for router in routers:
            t0 = time.perf_counter()
            kwargs = ({"imbalanced_threshold": args.router_imbalanced_threshold}
                      if router == "cache_aware" and args.router_imbalanced_threshold is not None else None)
            serve.run(build_app(cfg, ServerConfig("bench"), num_replicas=args.replicas, router=router,
                                router_kwargs=kwargs,
                                num_cpus_per_replica=args.num_cpus_per_replica,
                                routing_stats_period_s=args.routing_stats_period),
                      name="prefixkv", route_prefix="/")
            asyncio.run(_wait_up(base, args.replicas, 600))
            startup = time.perf_counter() - t0
            doc = asyncio.run(_drive(base, bodies, args))
            doc["startup_s"] = round(startup, 2)
            runs[router] = doc
            print(f"{router:>16}: hit {doc['prefix_hit_fraction']}, TTFT p50 {doc['ttft_s']['p50']:.3f} s "
                  f"p99 {doc['ttft_s']['p99']:.3f} s, {doc['output_tokens_per_s']} tok/s, "
                  f"{doc['request_throughput']} req/s, errors {doc['errors']}", flush=True)
            serve.delete("prefixkv")
    finally:
        serve.shutdown()
        ray.shutdown()
    ratios = {}
    base_run = runs.get("power_of_two")
    if base_run:
        for router, doc in runs.items():
            ratios[router] = {
                "hit_rate_x": round(doc["prefix_hit_fraction"] / base_run["prefix_hit_fraction"], 3)
                if base_run["prefix_hit_fraction"] else None,
                "ttft_p50_x_better": round(base_run["ttft_s"]["p50"] / doc["ttft_s"]["p50"], 3),
                "ttft_p99_x_better": round(base_run["ttft_s"]["p99"] / doc["ttft_s"]["p99"], 3),
                "throughput_x": round(doc["output_tokens_per_s"] / base_run["output_tokens_per_s"], 3),
            }
            print(f"{router:>16} vs power_of_two: {ratios[router]}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ray-routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    params = {k: v for k, v in vars(args).items() if k not in ("out",)}
    params["num_kv_blocks"] = num_blocks
    path.write_text(json.dumps({"command": command, "machine": machine_info(args.threads), "params": params,
                                "ratios_vs_power_of_two": ratios,
                                "runs": {r: {k: v for k, v in d.items() if k != "requests"} for r, d in runs.items()},
                                "requests": {r: d["requests"] for r, d in runs.items()}}, indent=1))
    print(f"wrote {path}")
    return 0
