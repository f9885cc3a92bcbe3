"""The Ray Serve application: ``build_app`` (for ``serve.run`` or a user's own Serve config) and
``prefixkv serve --replicas N`` (``run_ray_server``)::

    Serve's HTTP proxy -> PrefixKVIngress (OpenAI layer, tokenizer) -> EngineReplica x N (AsyncEngine)
                                   | its handle's request router (serve/router.py): the replicas'
                                   | cache digests, arriving as Serve routing stats

Example::

    from ray import serve
    from prefixkv.serve import build_app
    serve.run(build_app(EngineConfig(), ServerConfig("smollm2"), num_replicas=2), route_prefix="/")
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prefixkv.config import EngineConfig
    from prefixkv.server.serving import ServerConfig

logger = logging.getLogger(__name__)

REPLICA_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "PrefixKVIngress"
# --router name -> class in serve/router.py (named, so that only the replicas' callers import it)
ROUTERS = {"cache_aware": "CacheAwareRouter", "cache_threshold": "CacheThresholdRouter",
           "power_of_two": "PowerOfTwoRouter", "prefix_affinity": "PrefixAffinityRouter"}
CACHE_VIEWS = ("digests", "events")  # --routing-cache-view (serve/router.py's cache_view)


def build_app(engine_config: EngineConfig | None = None, server_config: ServerConfig | None = None, *,
              num_replicas: int = 1, autoscaling_config: dict[str, Any] | None = None,
              num_cpus_per_replica: float = 1.0, num_gpus_per_replica: float = 0.0, router: str = "cache_aware",
              router_kwargs: dict[str, Any] | None = None, routing_stats_period_s: float = 1.0,
              max_ongoing_requests: int | None = None, health_check_period_s: float = 2.0,
              engine_process: bool = True, routing_cache_view: str = "digests"):
    """The Serve application: one ingress and ``num_replicas`` engine replicas (or Serve's
    autoscaling between ``autoscaling_config``'s min and max), routed by ``router``; each replica's
    engine steps in its own process unless ``engine_process`` is False (serve/replica.py).

    ``routing_cache_view``: what the cache-aware routers know of each replica's cache: its digest,
    published with its routing stats every ``routing_stats_period_s`` (``digests``), or its KV
    events as they happen (``events``: every replica publishes them on its own endpoints, which
    this turns on; the digest stays the fallback for a view that lost batches)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from prefixkv.config import EngineConfig, KVEventsConfig
    from prefixkv.model.loader import resolve_model
    from prefixkv.serve.ingress import OpenAIIngress
    from prefixkv.server.serving import ServerConfig
    from prefixkv.serve.replica import EngineReplica

    engine_config = engine_config or EngineConfig()
    if router not in ROUTERS:
        raise ValueError(f"router: must be one of {', '.join(ROUTERS)}, got {router!r}")
    if routing_cache_view not in CACHE_VIEWS:
        raise ValueError(f"routing_cache_view: must be one of {', '.join(CACHE_VIEWS)}, got {routing_cache_view!r}")
    if routing_cache_view == "events":
        if router not in ("cache_aware", "cache_threshold"):
            raise ValueError(f"routing_cache_view: events applies to the cache_aware and cache_threshold routers "
                             f"(the router is {router})")
        router_kwargs = {**(router_kwargs or {}), "cache_view": "events"}
        if not engine_config.kv_events.enable_kv_cache_events:
            engine_config = dataclasses.replace(engine_config, kv_events=dataclasses.replace(
                engine_config.kv_events, enable_kv_cache_events=True, publisher="zmq"))
    events = engine_config.kv_events
    if events.enable_kv_cache_events and (events.endpoint != KVEventsConfig.endpoint
                                          or events.replay_endpoint is not None):
        # one address for all would collide: each replica binds free ports of its node (serve/replica.py)
        raise ValueError("kv_events_config.endpoint: with replicas each one binds its own endpoints (free TCP ports "
                         "of its node, listed in /health); leave endpoint and replay_endpoint unset")
    if autoscaling_config is None and num_replicas < 1:
        raise ValueError(f"replicas: must be >= 1, got {num_replicas}")
    if not routing_stats_period_s > 0:
        raise ValueError(f"routing_stats_period_s: must be positive, got {routing_stats_period_s}")
    if num_cpus_per_replica < 0 or num_gpus_per_replica < 0:
        raise ValueError("num_cpus_per_replica / num_gpus_per_replica: must be >= 0")
    model_path = resolve_model(engine_config.model)  # a GGUF is converted once, here
    engine_config = dataclasses.replace(engine_config, model=str(model_path))
    server_config = server_config or ServerConfig(model_name=model_path.name)
    sched = engine_config.scheduler
    per_replica = max_ongoing_requests or (sched.max_num_seqs + sched.max_waiting_requests)
    scaling: dict[str, Any] = ({"autoscaling_config": autoscaling_config} if autoscaling_config is not None
                               else {"num_replicas": num_replicas})
    replica = serve.deployment(EngineReplica, name=REPLICA_DEPLOYMENT).options(
        **scaling,
        ray_actor_options={"num_cpus": num_cpus_per_replica, "num_gpus": num_gpus_per_replica},
        max_ongoing_requests=per_replica,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=60.0,
        graceful_shutdown_timeout_s=10.0,
        request_router_config=RequestRouterConfig(
            request_router_class=f"prefixkv.serve.router:{ROUTERS[router]}",
            request_router_kwargs=dict(router_kwargs or {}),
            request_routing_stats_period_s=routing_stats_period_s,
            request_routing_stats_timeout_s=max(5.0, 5 * routing_stats_period_s)),
    )
    ingress = serve.deployment(OpenAIIngress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1, ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(engine_config, server_config.cache_view_text, engine_process=engine_process),
                        str(model_path), server_config, REPLICA_DEPLOYMENT, routing_stats_period_s)


def autoscaling_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """``--autoscaling-config FILE`` (JSON: Serve's autoscaling_config) or the min/max flags."""
    conf: dict[str, Any] | None = None
    if args.autoscaling_config:
        try:
            with open(args.autoscaling_config) as f:
                conf = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"autoscaling_config: cannot read {args.autoscaling_config}: {e}") from None
        if not isinstance(conf, dict):
            raise ValueError("autoscaling_config: the file must hold a JSON object")
    if args.min_replicas is not None or args.max_replicas is not None or args.target_ongoing_requests is not None:
        conf = dict(conf or {})
        if args.min_replicas is not None or "min_replicas" not in conf:
            conf["min_replicas"] = args.min_replicas if args.min_replicas is not None else 1
        if args.max_replicas is not None or "max_replicas" not in conf:
            conf["max_replicas"] = (args.max_replicas if args.max_replicas is not None
                                    else max(conf["min_replicas"], args.replicas or 1))
        if args.target_ongoing_requests is not None:
            conf["target_ongoing_requests"] = args.target_ongoing_requests
    if conf is not None:
        from ray.serve.config import AutoscalingConfig

        try:
            AutoscalingConfig(**conf)
        except Exception as e:  # pydantic's message names the field
            raise ValueError(f"autoscaling_config: {e}") from None
    return conf


# --router-* flag -> the router it belongs to
_ROUTER_FLAGS = {"imbalanced_threshold": "cache_threshold", "min_match_tokens": "cache_threshold",
                 "speeds": "cache_aware"}


def router_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--router-*`` flags given, as the chosen router's kwargs (another router's are refused)."""
    given = {k: getattr(args, "router_" + k) for k in _ROUTER_FLAGS if getattr(args, "router_" + k) is not None}
    for k in given:
        if _ROUTER_FLAGS[k] != args.router:
            raise ValueError(f"--router-{k.replace('_', '-')}: applies to --router {_ROUTER_FLAGS[k]} only "
                             f"(the router is {args.router})")
    return given


def run_ray_server(args: argparse.Namespace, engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """``prefixkv serve --replicas N``: start (or join, ``--ray-address``) Ray, run the app, serve
    until SIGTERM/SIGINT, then shut the application down."""
    import ray
    from ray import serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.replicas is None:  # autoscaling or --ray-address alone
        args.replicas = args.min_replicas or 1
    app = build_app(engine_config, server_config, num_replicas=args.replicas,
                    autoscaling_config=autoscaling_from_args(args), num_cpus_per_replica=args.num_cpus_per_replica,
                    num_gpus_per_replica=args.num_gpus_per_replica, router=args.router,
                    router_kwargs=router_kwargs_from_args(args),
                    routing_stats_period_s=args.routing_stats_period, engine_process=args.engine_process,
                    routing_cache_view=args.routing_cache_view)
    # "local": a new instance of our own unless --ray-address names one (a bare init would join
    # whatever cluster this machine last started, even a dead one)
    ray.init(address=args.ray_address or "local", include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k.startswith("PREFIXKV_")}})
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="prefixkv", route_prefix="/")
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"prefixkv serving {server_config.model_name} at http://{host}:{args.port} on Ray Serve "
          f"({args.replicas} replicas, router {args.router})", flush=True)
    stop = threading.Event()
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    logger.info("shutting down the Serve application")
    serve.shutdown()
    ray.shutdown()
    return 0


def add_ray_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas (Ray Serve)")
    g.add_argument("--replicas", type=int, default=None,
                   help="serve N engine replicas on Ray Serve behind one ingress (off: one process, no Ray)")
    g.add_argument("--ray-address", default=None, help="join this Ray cluster (default: start a local one)")
    g.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    g.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    g.add_argument("--router", choices=tuple(ROUTERS), default="cache_aware",
                   help="cache_aware (default): the replica with the least expected time to first token, "
                        "(P + L - H) / rate + N * step, from the replicas' cache digests and loads (L: the "
                        "prompt's tokens, H: those the replica holds, N and P: requests and prompt tokens to "
                        "compute ahead, rate and step: its measured prefill rate and decode step time; a request "
                        "counts from the decision); cache_threshold: the longest cached prefix within "
                        "--router-imbalanced-threshold, the rule before it; power_of_two: Serve's default; "
                        "prefix_affinity: Ray Serve LLM's PrefixCacheAffinityRouter")
    g.add_argument("--router-speeds", choices=("deployment", "replica"), default=None,
                   help="cache_aware: weigh every replica at the median of the replicas' measured speeds "
                        "(deployment, the default) or each at its own (replica: replicas on unlike nodes)")
    g.add_argument("--router-imbalanced-threshold", type=int, default=None,
                   help="cache_threshold: follow a cached prefix only while its replica has at most this many more "
                        "requests in flight than the least loaded one (default 16)")
    g.add_argument("--router-min-match-tokens", type=int, default=None,
                   help="cache_threshold: shorter cached prefixes do not steer the request (default 1)")
    g.add_argument("--routing-stats-period", type=float, default=1.0,
                   help="seconds between the replicas' cache digests")
    g.add_argument("--routing-cache-view", choices=CACHE_VIEWS, default="digests",
                   help="what cache_aware and cache_threshold know of each replica's prefix cache: digests (the "
                        "default): its cache digest, every --routing-stats-period; events: its KV events as they "
                        "happen (vLLM's schema, on the replica's own endpoints, turned on by this; a gap the replay "
                        "socket cannot fill falls back to the digest)")
    g.add_argument("--min-replicas", type=int, default=None, help="autoscaling: the fewest replicas")
    g.add_argument("--max-replicas", type=int, default=None, help="autoscaling: the most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling: requests in flight per replica that Serve scales toward")
    g.add_argument("--autoscaling-config", default=None,
                   help="autoscaling: a JSON file with Serve's autoscaling_config (min_replicas, max_replicas, ...)")

