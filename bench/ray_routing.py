"""``python -m bench ray-routing``: traffic across engine replicas on Ray Serve, one application per
request router, the same traffic for every router, in one command.

Traffics (``--traffic``, in this order on each application):

- ``shared``: multi-tenant shared prefixes. ``--groups`` system prompts of ``--system-tokens``
  tokens, ``--users`` requests each (own question, ``--output-tokens`` greedy tokens), interleaved
  in one shuffled order with Poisson arrivals at ``--rate`` requests/s (``bench serving``'s
  prompts, client and statistics). It runs first, on cold caches. Each replica's KV pool is
  ``--num-kv-blocks`` blocks: by default half of the system prompts fit in one replica, with room to
  compute one whole prompt beside them.
- ``burst``: ``--burst-requests`` unrelated prompts of ``--burst-prompt-tokens`` tokens (disjoint
  text), ``--burst-output-tokens`` each, at every rate of ``--burst-rates`` (``inf``: all at once;
  Poisson otherwise, the same unit draws scaled), fresh prompts at each rate.
- ``template``: the same sizes, every prompt starting with one short shared system prompt of
  ``--template-tokens`` (a chat template's default: 2 blocks), at ``--template-rates``.

Routers (``--routers``): power_of_two (Serve's default), prefix_affinity (Ray Serve LLM's
``PrefixCacheAffinityRouter``), cache_threshold (prefixkv's longest-cached-prefix rule with an
imbalance threshold, the rule before issue 43) and cache_aware (prefixkv's cost model, the
default). ``--cache-view digests,events`` runs cache_threshold and cache_aware once per view of the
replicas' caches (``--routing-cache-view``: periodic digests, or KV events), the events runs named
``cache_aware+events``. For each of ``--repeat`` rounds, the routers run in a rotated order (A/B alternation),
each on a fresh application (new replicas, cold caches), all through the ingress's
/v1/completions (token ids). Reported per traffic and rate: prefix-cache hit fraction (the
client's usage), TTFT p50/p90/p99, output tokens/s and requests/s over the run, requests per
replica (the router's routed counts), the router's decisions, and each router's ratios against
power_of_two (medians over the rounds). One local Ray instance with ``--cpus`` CPUs; each replica
gets ``--num-cpus-per-replica`` of them (OpenMP threads follow).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from bench import workloads as wl
from bench.corpus import TokenStream
from bench.serving import Prompt, build_prompts, parse_rates, rate_label, request_body, run_rate, summarize

ROUTERS = ("power_of_two", "prefix_affinity", "cache_threshold", "cache_aware")
CACHE_VIEWS = ("digests", "events")
VIEW_ROUTERS = ("cache_threshold", "cache_aware")  # the routers that read a cache view
TRAFFICS = ("shared", "burst", "template")
PROG = "bench ray-routing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--traffic", default=",".join(TRAFFICS), help="which traffics, of " + ", ".join(TRAFFICS))
    p.add_argument("--cache-view", default="digests",
                   help="the cache views cache_threshold and cache_aware run with, of " + ", ".join(CACHE_VIEWS)
                        + " (several: each router once per view, e.g. digests,events)")
    p.add_argument("--repeat", type=int, default=1, help="rounds over the routers, their order rotated each round")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray instance")
    p.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    s = p.add_argument_group("shared traffic")
    s.add_argument("--groups", type=int, default=8)
    s.add_argument("--users", type=int, default=12, help="requests per system prompt")
    s.add_argument("--system-tokens", type=int, default=1000)
    s.add_argument("--question-tokens", type=int, default=24)
    s.add_argument("--output-tokens", type=int, default=16)
    s.add_argument("--rate", type=float, default=1.5, help="requests/s (Poisson)")
    b = p.add_argument_group("burst and template traffic")
    b.add_argument("--burst-requests", type=int, default=32, help="requests per rate")
    b.add_argument("--burst-prompt-tokens", type=int, default=256)
    b.add_argument("--burst-output-tokens", type=int, default=32)
    b.add_argument("--burst-rates", default="inf,1,2,4", help="requests/s; inf = all at once")
    b.add_argument("--template-tokens", type=int, default=32, help="the template traffic's shared system prompt")
    b.add_argument("--template-rates", default="inf")
    e = p.add_argument_group("engine")
    e.add_argument("--num-kv-blocks", type=int, default=None,
                   help="per replica (default: half the system prompts' blocks plus room for one whole prompt)")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--max-num-seqs", type=int, default=16)
    e.add_argument("--model", default=None)
    e.add_argument("--dtype", default="float32")
    e.add_argument("--routing-stats-period", type=float, default=1.0)
    e.add_argument("--router-imbalanced-threshold", type=int, default=None,
                   help="cache_threshold's (default: its own, serve/router.py)")
    r = p.add_argument_group("run")
    r.add_argument("--request-timeout", type=float, default=900.0)
    r.add_argument("--max-seconds", type=float, default=3600.0)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    r.add_argument("--no-progress", action="store_true")
    r.add_argument("--threads", type=int, default=1)


@dataclass
class Traffic:
    label: str  # traffic@rate
    rate: float
    bodies: list[tuple[Prompt, dict]]


def build_traffic(pb: wl.PromptBuilder, args: argparse.Namespace, traffics: list[str]) -> list[Traffic]:
    """Every traffic's requests, built once: every router gets the same ones."""
    out = []
    if "shared" in traffics:
        prompts = build_prompts(pb, args.groups, args.groups * args.users, args.system_tokens, args.question_tokens,
                                args.seed)
        out.append(Traffic(f"shared@{rate_label(args.rate)}", args.rate,
                           [(q, request_body(pb, q, "completions", args.output_tokens)) for q in prompts]))
    n, size = args.burst_requests, args.burst_prompt_tokens
    if "burst" in traffics:
        for rate in parse_rates(args.burst_rates):
            prompts = [Prompt(i, [], pb.block(size, wl.USER_HEAD, wl.END + wl.ASSISTANT_HEAD)) for i in range(n)]
            out.append(Traffic(f"burst@{rate_label(rate)}", rate,
                               [(q, request_body(pb, q, "completions", args.burst_output_tokens)) for q in prompts]))
    if "template" in traffics:
        for rate in parse_rates(args.template_rates):
            template = pb.block(args.template_tokens, wl.SYSTEM_HEAD, wl.END)
            prompts = [Prompt(0, template, pb.block(size - args.template_tokens, wl.USER_HEAD,
                                                    wl.END + wl.ASSISTANT_HEAD)) for _ in range(n)]
            out.append(Traffic(f"template@{rate_label(rate)}", rate,
                               [(q, request_body(pb, q, "completions", args.burst_output_tokens)) for q in prompts]))
    return out


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _wait_up(base: str, replicas: int, timeout: float) -> None:
    import aiohttp

    end = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < end:
            try:
                async with http.get(base + "/health") as r:
                    if r.status == 200 and len((await r.json()).get("replicas", {})) >= replicas:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"{PROG}: the application did not come up within {timeout:g} s")


def _labelled_delta(before: dict, after: dict, metric: str) -> dict[str, int]:
    """{label value: increase} of a labelled counter between two scrapes."""
    out = {}
    for k, v in after.items():
        if k.startswith(metric + "{"):
            out[k.split('"')[1]] = int(v - before.get(k, 0.0))
    return out


async def _drive(base: str, traffic: list[Traffic], args: argparse.Namespace) -> dict[str, dict]:
    import aiohttp

    docs = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        for t in traffic:
            run = await run_rate(http, base, "/v1/completions", t.bodies, t.rate, args, {})
            doc = summarize(run)
            doc["routed"] = sorted(_labelled_delta(run.metrics_before, run.metrics_after,
                                                   "prefixkv_replica_routed_requests_total").values(), reverse=True)
            doc["decisions"] = {k: v for k, v in _labelled_delta(run.metrics_before, run.metrics_after,
                                                                 "prefixkv_router_decisions_total").items() if v}
            docs[t.label] = doc
    return docs


def _line(router: str, label: str, doc: dict) -> str:
    ttft = doc["ttft_s"] or {}
    return (f"{router:>22} {label:>14}: hit {doc['prefix_hit_fraction']}, TTFT p50 {ttft.get('p50', 0):.3f} s "
            f"p99 {ttft.get('p99', 0):.3f} s, {doc['output_tokens_per_s']} tok/s, {doc['request_throughput']} req/s, "
            f"per replica {doc['routed']}, decisions {doc['decisions']}, errors {doc['errors']}")


def _ratios(rounds: list[dict[str, dict[str, dict]]], base_of=lambda name: "power_of_two") -> dict[str, dict[str, dict]]:
    """traffic -> router -> medians over the rounds of its ratios to its base run's (``base_of`` its
    name: power_of_two's, or for ``X+events`` the digests run of X)."""
    def ratio(a, b):
        return a / b if a and b else None

    out: dict[str, dict[str, dict]] = {}
    for rnd in rounds:
        for router, docs in rnd.items():
            base = rnd.get(base_of(router))
            if not base:
                continue
            for label, doc in docs.items():
                ref = base.get(label)
                if ref is None or doc["ttft_s"] is None or ref["ttft_s"] is None:
                    continue
                d = out.setdefault(label, {}).setdefault(router, {"hit_rate_x": [], "ttft_p50_x_better": [],
                                                                  "ttft_p99_x_better": [], "throughput_x": []})
                d["hit_rate_x"].append(ratio(doc["prefix_hit_fraction"], ref["prefix_hit_fraction"]))
                d["ttft_p50_x_better"].append(ratio(ref["ttft_s"]["p50"], doc["ttft_s"]["p50"]))
                d["ttft_p99_x_better"].append(ratio(ref["ttft_s"]["p99"], doc["ttft_s"]["p99"]))
                d["throughput_x"].append(ratio(doc["output_tokens_per_s"], ref["output_tokens_per_s"]))
    for routers in out.values():
        for d in routers.values():
            for k, xs in d.items():
                xs = [x for x in xs if x is not None]
                d[k] = round(statistics.median(xs), 3) if xs else None
    return out


def cmd_ray_routing(args: argparse.Namespace, command: str) -> int:
    import ray
    from ray import serve

    from bench.cli_impl import load_tokenizer
    from bench.run import _loadavg, machine_info
    from prefixkv.engine_args import EngineArgs
    from prefixkv.serve import build_app
    from prefixkv.server.serving import ServerConfig

    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    traffics = [t.strip() for t in args.traffic.split(",") if t.strip()]
    views = [v.strip() for v in args.cache_view.split(",") if v.strip()]
    for what, given, known in (("routers", routers, ROUTERS), ("traffic", traffics, TRAFFICS),
                               ("cache-view", views, CACHE_VIEWS)):
        bad = [x for x in given if x not in known]
        if bad or not given:
            raise SystemExit(f"{PROG}: --{what}: unknown or none {bad}; choose from {', '.join(known)}")
    if args.repeat < 1:
        raise SystemExit(f"{PROG}: --repeat: must be >= 1")
    # (name, router, view): a router that reads a cache view once per view
    runs = [(r if v == "digests" else f"{r}+{v}", r, v) for r in routers
            for v in (views if r in VIEW_ROUTERS else ["digests"])]
    if not 0 < args.template_tokens < args.burst_prompt_tokens:
        raise SystemExit(f"{PROG}: --template-tokens: must be between 0 and --burst-prompt-tokens")
    load0 = _loadavg()
    machine = machine_info(args.threads)
    _, tok = load_tokenizer(args.model)
    pb = wl.PromptBuilder(tok, TokenStream.build(tok))
    traffic = build_traffic(pb, args, traffics)
    bs = args.block_size
    per_prompt = -(-(args.system_tokens + args.question_tokens + args.output_tokens) // bs)
    # half the system prompts, and room to compute one request's whole prompt beside them
    num_blocks = args.num_kv_blocks or (args.groups // 2) * -(-args.system_tokens // bs) + per_prompt
    cfg = EngineArgs(model=args.model, dtype=args.dtype, block_size=bs, num_kv_blocks=num_blocks,
                     max_num_seqs=args.max_num_seqs).create_engine_config()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ray-routing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    params = {k: v for k, v in vars(args).items() if k not in ("out",)}
    params["num_kv_blocks"] = num_blocks
    rounds: list[dict[str, dict[str, dict]]] = []
    startups: dict[str, list[float]] = {}
    t_start = time.time()

    def save() -> dict:  # after every router: a run cut off keeps what it measured
        ratios = _ratios(rounds)
        view_ratios = {label: {r: d for r, d in by.items() if "+" in r}
                       for label, by in _ratios(rounds, lambda name: name.split("+")[0]).items()}
        strip = lambda d: {k: v for k, v in d.items() if k != "requests"}  # noqa: E731
        path.write_text(json.dumps({
            "command": command, "machine": machine, "loadavg_start": load0, "loadavg_end": _loadavg(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t_start)), "params": params,
            "startup_s": startups, "ratios_vs_power_of_two": ratios, "events_vs_digests": view_ratios,
            "rounds": [{r: {label: strip(d) for label, d in docs.items()} for r, docs in rnd.items()} for rnd in rounds],
            "requests": [{r: {label: d["requests"] for label, d in docs.items()} for r, docs in rnd.items()}
                         for rnd in rounds]}, indent=1))
        return ratios, view_ratios

    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    port = _port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    try:
        for k in range(args.repeat):
            rnd: dict[str, dict[str, dict]] = {}
            rounds.append(rnd)
            for name, router, view in runs[k % len(runs):] + runs[:k % len(runs)]:
                t0 = time.perf_counter()
                kwargs = ({"imbalanced_threshold": args.router_imbalanced_threshold}
                          if router == "cache_threshold" and args.router_imbalanced_threshold is not None else None)
                serve.run(build_app(cfg, ServerConfig("bench"), num_replicas=args.replicas, router=router,
                                    router_kwargs=kwargs, num_cpus_per_replica=args.num_cpus_per_replica,
                                    routing_stats_period_s=args.routing_stats_period, routing_cache_view=view),
                          name="prefixkv", route_prefix="/")
                asyncio.run(_wait_up(base, args.replicas, 600))
                startups.setdefault(name, []).append(round(time.perf_counter() - t0, 2))
                rnd[name] = asyncio.run(_drive(base, traffic, args))
                for label, doc in rnd[name].items():
                    print(f"round {k + 1} " + _line(name, label, doc), file=sys.stderr, flush=True)
                save()
                serve.delete("prefixkv")
    finally:
        serve.shutdown()
        ray.shutdown()
    ratios, view_ratios = save()
    for base, table in (("power_of_two", ratios), ("its digests run", view_ratios)):
        for label, by_router in table.items():
            for router, d in by_router.items():
                print(f"{label:>14} {router:>22} vs {base} (median of {len(rounds)}): {d}", flush=True)
    print(f"wrote {path}")
    errors = sum(d["errors"] for rnd in rounds for docs in rnd.values() for d in docs.values())
    if errors:
        print(f"{PROG}: {errors} requests failed (see error_reasons in {path})", file=sys.stderr)
    return 0 if not errors else 1
