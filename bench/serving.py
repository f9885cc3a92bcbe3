"""``python -m bench serving``: latency of ``prefixkv serve`` against the request rate.

A load generator on loopback: for each rate of ``--rates`` it sends ``--num-requests`` streaming
requests with Poisson arrivals (exponential gaps drawn from ``random.Random(seed)``; the same draws,
scaled by 1/rate, at every rate; ``inf`` sends them all at once). Requests share a system prompt,
as in a chat backend (``--groups`` distinct ones, 1 by default), and each has its own question: the
shared-prefix workload's prompts (``bench.workloads.shared_prefix``), fresh questions at every rate.

Per request, timed on the client with ``time.perf_counter``::

    send ........ first content chunk ........ last content chunk .. [DONE]
    |---- TTFT ----|---- (output tokens - 1) x TPOT ----|
    |------------------------ latency ---------------------------------|

Output tokens and cached prompt tokens come from the stream's usage chunk. Greedy, ``ignore_eos``
(every request generates exactly ``--output-tokens``), ``skip_special_tokens`` false so that every
token reaches the client as text (a skipped special token would hide its time).

Per rate: TTFT, TPOT and latency p50/p90/p99, output tokens/s (total output tokens / (last finish -
first send)), achieved request rate, prefix-cache hit fraction (client usage and the server's
/metrics counters), errors (non-200, SSE error event, client timeout) and requests not sent because
``--max-seconds`` had passed. Writes one JSON and a PNG like the other workloads.

Spawns ``prefixkv serve`` on 127.0.0.1 (a free port; engine arguments after ``--``) unless ``--url``
names a running server, which must be on a loopback address.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bench import workloads as wl
from bench.corpus import TokenStream
from bench.server_client import SSEEvents, SpawnedServer, check_loopback, drain, scrape, wait_health

PROG = "bench serving"
PERCENTILES = (50, 90, 99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument("--rates", default="0.25,0.5,1,inf",
                   help="comma-separated requests/s; inf = all at once (default: %(default)s)")
    g.add_argument("--num-requests", type=int, default=16, help="requests per rate (default: %(default)s)")
    g.add_argument("--max-seconds", type=float, default=120.0,
                   help="per rate: requests whose arrival falls later are not sent (counted) (default: %(default)s)")
    g.add_argument("--request-timeout", type=float, default=300.0, help="client timeout of one request, s")
    g.add_argument("--endpoint", default="chat", choices=["chat", "completions"],
                   help="/v1/chat/completions (text messages) or /v1/completions (token ids)")
    g.add_argument("--warmup", type=int, default=1,
                   help="uncounted requests per system prompt before the first rate (server warm, prefix cached)")
    s = p.add_argument_group("prompt sizes")
    s.add_argument("--groups", type=int, default=1, help="distinct shared system prompts (default: %(default)s)")
    s.add_argument("--system-tokens", type=int, default=256, help="S: system-prompt tokens (default: %(default)s)")
    s.add_argument("--question-tokens", type=int, default=32, help="Q: per-request question tokens (default: %(default)s)")
    s.add_argument("--output-tokens", type=int, default=32, help="O: output tokens per request (default: %(default)s)")
    t = p.add_argument_group("server")
    t.add_argument("--url", default=None, help="a running server, http://127.0.0.1:PORT (loopback only); "
                                               "default: spawn `prefixkv serve`")
    t.add_argument("--model", default=None, help="model dir or .gguf: the spawned server's, and the tokenizer "
                                                 "that builds prompts (default: embedded SmolLM2-135M-Instruct)")
    t.add_argument("--dtype", default="float32", help="the spawned server's --dtype (default: %(default)s)")
    t.add_argument("--api-key", default=None)
    t.add_argument("--server-log", default=None, help="where the spawned server's stderr goes (default: a temp file)")
    t.add_argument("--startup-seconds", type=float, default=600.0)
    t.add_argument("server_args", nargs="*", metavar="-- SERVER_ARGS",
                   help="after --: arguments of the spawned `prefixkv serve` (e.g. -- --num-kv-blocks 512)")
    r = p.add_argument_group("run")
    r.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"),
                   help="directory for the JSON and PNG (default: bench/out/)")
    r.add_argument("--stem", default=None, help="file name stem of the JSON/PNG (default: serving-time)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--threads", type=int, default=1, help="torch threads of this client process (default: %(default)s)")
    r.add_argument("--no-plot", action="store_true")
    r.add_argument("--no-progress", action="store_true")


def parse_rates(text: str) -> list[float]:
    rates = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            rate = math.inf if part in ("inf", "infinity") else float(part)
        except ValueError:
            raise SystemExit(f"bench serving: --rates: {part!r} is not a number or inf") from None
        if not rate > 0:
            raise SystemExit(f"bench serving: --rates: {part!r} must be positive")
        rates.append(rate)
    if not rates:
        raise SystemExit("bench serving: --rates: no rate given")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


# ---------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class Prompt:
    group: int
    system_ids: list[int]
    question_ids: list[int]


def build_prompts(pb: wl.PromptBuilder, groups: int, count: int, system_tokens: int, question_tokens: int,
                  seed: int) -> list[Prompt]:
    """``count`` shared-prefix prompts (``groups`` system prompts, shuffled), split at the system prompt."""
    per_group = -(-count // groups)
    w = wl.shared_prefix(pb, groups, per_group, system_tokens, question_tokens, 1, seed)
    first_seen: dict[tuple[int, ...], int] = {}
    out = []
    for r in w.rounds[0][:count]:
        system = tuple(r.prompt[:system_tokens])
        group = first_seen.setdefault(system, len(first_seen))
        out.append(Prompt(group, list(system), r.prompt[system_tokens:]))
    return out


def _strip(ids: list[int], head: list[int], tail: list[int]) -> list[int]:
    if len(ids) >= len(head) + len(tail) and ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail:
        return ids[len(head):len(ids) - len(tail)]
    return ids


def request_body(pb: wl.PromptBuilder, prompt: Prompt, endpoint: str, output_tokens: int) -> dict:
    """Completions: the exact token ids (ChatML markers included). Chat: the system and question text
    without the markers, which the server's chat template puts back."""
    body = {"max_tokens": output_tokens, "temperature": 0.0, "ignore_eos": True, "skip_special_tokens": False,
            "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "completions":
        body["prompt"] = prompt.system_ids + prompt.question_ids
        return body
    system = _strip(prompt.system_ids, pb.enc(wl.SYSTEM_HEAD), pb.enc(wl.END))
    question = _strip(prompt.question_ids, pb.enc(wl.USER_HEAD), pb.enc(wl.END + wl.ASSISTANT_HEAD))
    body["messages"] = [{"role": "system", "content": pb.tok.decode(system)},
                        {"role": "user", "content": pb.tok.decode(question)}]
    return body


# ---------------------------------------------------------------------- one request
@dataclass
class Result:
    index: int
    group: int
    scheduled_s: float
    sent_s: float | None = None  # from the start of the rate
    status: int | None = None
    error: str | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    finish_s: float | None = None
    num_chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.sent_s is not None and self.error is None


async def send_one(http, url: str, body: dict, headers: dict, res: Result, t_rate: float,
                   timeout_s: float) -> None:
    import aiohttp

    t0 = time.perf_counter()
    res.sent_s = t0 - t_rate
    try:
        await asyncio.wait_for(_stream(http, url, body, headers, res, t0), timeout_s)
    except asyncio.TimeoutError:
        res.error = f"client timeout after {timeout_s:g} s"
    except aiohttp.ClientError as e:
        res.error = f"connection error: {type(e).__name__}: {e}"
    except (ValueError, AttributeError, TypeError) as e:  # not JSON, or not the OpenAI shape
        res.error = f"malformed response: {type(e).__name__}: {e}"


async def _stream(http, url: str, body: dict, headers: dict, res: Result, t0: float) -> None:
    t_first = t_last = None
    async with http.post(url, json=body, headers=headers) as resp:
        res.status = resp.status
        if resp.status != 200:
            res.error = f"HTTP {resp.status}: {(await resp.read())[:200].decode('utf-8', 'replace')}"
            return
        events = SSEEvents(resp.content)
        async for event in events:
            now = time.perf_counter()
            if "error" in event:
                err = event["error"]
                res.error = f"SSE error: {err.get('type')}/{err.get('code')}: {err.get('message')}"
                return
            if any((c.get("delta") or {}).get("content") or c.get("text") for c in event.get("choices") or ()):
                t_first = t_first or now
                t_last = now
                res.num_chunks += 1
            usage = event.get("usage")
            if usage:
                res.prompt_tokens = usage.get("prompt_tokens")
                res.output_tokens = usage.get("completion_tokens")
                res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    t_end = time.perf_counter()
    if not events.done:
        res.error = "stream ended without [DONE]"
    elif t_first is None:
        res.error = "no content chunk"
    elif res.output_tokens is None:
        res.error = "no usage chunk"
    if res.error:
        return
    res.ttft_s = t_first - t0
    res.latency_s = t_end - t0
    res.finish_s = res.sent_s + res.latency_s
    if res.output_tokens > 1:
        res.tpot_s = (t_last - t_first) / (res.output_tokens - 1)


# ---------------------------------------------------------------------- one rate
def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start of the rate at which each request is sent: a Poisson process (the
    same unit-rate draws for every rate, scaled); all zero for ``inf``."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(1.0) for _ in range(n)]
    if math.isinf(rate):
        return [0.0] * n
    t, out = 0.0, []
    for i, g in enumerate(gaps):
        if i:  # the first request goes at once
            t += g / rate
        out.append(t)
    return out


@dataclass
class RateRun:
    rate: float
    results: list[Result] = field(default_factory=list)
    metrics_before: dict = field(default_factory=dict)
    metrics_after: dict = field(default_factory=dict)


async def run_rate(http, base: str, path: str, bodies: list[tuple[Prompt, dict]], rate: float,
                   args: argparse.Namespace, headers: dict) -> RateRun:
    from tqdm import tqdm

    run = RateRun(rate)
    run.metrics_before = await scrape(http, base)
    offsets = arrival_offsets(len(bodies), rate, args.seed)
    bar = tqdm(total=len(bodies), desc=f"serving rate {rate_label(rate)}/s", unit="req",
               disable=args.no_progress, leave=False, file=sys.stderr)
    tasks = []
    t_rate = time.perf_counter()
    for i, ((prompt, body), offset) in enumerate(zip(bodies, offsets)):
        res = Result(i, prompt.group, round(offset, 4))
        run.results.append(res)
        if offset > args.max_seconds:
            res.error = "not sent: --max-seconds reached"
            bar.update(1)
            continue
        delay = t_rate + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(send_one(http, base + path, body, headers, res, t_rate, args.request_timeout))
        task.add_done_callback(lambda _t: bar.update(1))
        tasks.append(task)
    await asyncio.gather(*tasks)
    bar.close()
    _, run.metrics_after, _ = await drain(http, base, 30.0)  # a rate's aborted stragglers
    return run


def _pcts(values: list[float], scale: float = 1.0, nd: int = 6) -> dict | None:
    import numpy as np

    if not values:
        return None
    qs = np.percentile(np.asarray(values, dtype=np.float64) * scale, PERCENTILES)
    out = {f"p{p}": round(float(q), nd) for p, q in zip(PERCENTILES, qs)}
    out["mean"] = round(float(np.mean(values)) * scale, nd)
    return out


def _delta(run: RateRun, name: str) -> float | None:
    if name not in run.metrics_after:
        return None
    return run.metrics_after[name] - run.metrics_before.get(name, 0.0)


def summarize(run: RateRun) -> dict:
    res = run.results
    sent = [r for r in res if r.sent_s is not None]
    ok = [r for r in res if r.ok]
    errors = [r for r in sent if r.error]
    first_send = min((r.sent_s for r in sent), default=None)
    last_finish = max((r.finish_s for r in ok), default=None)
    window = (last_finish - first_send) if ok else None
    send_span = (max(r.sent_s for r in sent) - first_send) if len(sent) > 1 else None
    num_out = sum(r.output_tokens for r in ok)
    num_prompt = sum(r.prompt_tokens or 0 for r in ok)
    num_cached = sum(r.cached_tokens or 0 for r in ok)
    hit = _delta(run, "prefixkv_prefix_cache_hit_tokens_total")
    queried = _delta(run, "prefixkv_prefix_cache_queried_tokens_total")
    preempt = _delta(run, "prefixkv_preemptions_total")
    return dict(
        rate=rate_label(run.rate) if math.isinf(run.rate) else run.rate, rate_label=rate_label(run.rate),
        num_requests=len(res), sent=len(sent), not_sent=len(res) - len(sent), completed=len(ok),
        errors=len(errors), error_reasons=dict(Counter(r.error[:120] for r in errors).most_common(5)),
        send_span_s=round(send_span, 4) if send_span is not None else None,
        achieved_rate=round((len(sent) - 1) / send_span, 4) if send_span and not math.isinf(run.rate) else None,
        duration_s=round(window, 4) if window else None,
        request_throughput=round(len(ok) / window, 4) if window else None,
        output_tokens=num_out, output_tokens_per_s=round(num_out / window, 3) if window else None,
        prompt_tokens=num_prompt, cached_tokens=num_cached,
        prefix_hit_fraction=round(num_cached / num_prompt, 4) if num_prompt else None,
        server_prefix_hit_tokens=int(hit) if hit is not None else None,
        server_prefix_queried_tokens=int(queried) if queried is not None else None,
        server_prefix_hit_fraction=round(hit / queried, 4) if hit is not None and queried else None,
        server_preemptions=int(preempt) if preempt is not None else None,
        ttft_s=_pcts([r.ttft_s for r in ok]),
        tpot_s=_pcts([r.tpot_s for r in ok if r.tpot_s is not None]),
        latency_s=_pcts([r.latency_s for r in ok]),
        requests=[{k: (round(v, 5) if isinstance(v, float) else v) for k, v in asdict(r).items()} for r in res],
    )


# ---------------------------------------------------------------------- the run
async def run_all(base: str, args: argparse.Namespace, rates: list[float], bodies: list[list[tuple[Prompt, dict]]],
                  warmup: list[tuple[Prompt, dict]]) -> tuple[list[dict], dict]:
    import aiohttp

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    connector = aiohttp.TCPConnector(limit=args.num_requests + 8)
    info: dict = {}
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        await wait_health(http, base, 60, PROG)
        t0 = time.perf_counter()
        warm = []
        for prompt, body in warmup:  # one at a time: each system prompt's KV ends up in the prefix cache
            r = Result(-1, prompt.group, 0.0)
            await send_one(http, base + path, body, headers, r, time.perf_counter(), args.request_timeout)
            if r.error:
                raise SystemExit(f"bench serving: the warm-up request failed: {r.error}")
            warm.append(dict(group=r.group, ttft_s=round(r.ttft_s, 4), latency_s=round(r.latency_s, 4),
                             cached_tokens=r.cached_tokens, prompt_tokens=r.prompt_tokens))
        info["warmup"] = dict(requests=warm, seconds=round(time.perf_counter() - t0, 3))
        out = []
        for rate, rate_bodies in zip(rates, bodies):
            run = await run_rate(http, base, path, rate_bodies, rate, args, headers)
            out.append(summarize(run))
            print(f"rate {rate_label(rate)}/s: " + row(out[-1], plain=True), file=sys.stderr, flush=True)
    return out, info


def cmd_serving(args: argparse.Namespace, command: str) -> int:
    from bench.cli_impl import load_tokenizer
    from bench.run import _loadavg, machine_info, write_result

    rates = parse_rates(args.rates)
    if min(args.num_requests, args.groups, args.system_tokens, args.question_tokens, args.output_tokens) < 1:
        raise SystemExit("bench serving: --num-requests, --groups and the token counts must be positive")
    if args.url and args.server_args:
        raise SystemExit("bench serving: arguments after -- are for a spawned server (not with --url)")
    base = check_loopback(args.url, PROG) if args.url else None
    load0 = _loadavg()
    machine = machine_info(args.threads)
    _, tok = load_tokenizer(args.model)
    pb = wl.PromptBuilder(tok, TokenStream.build(tok))
    if args.endpoint == "chat":  # the ChatML markers are cut off for the message text: keep some text
        for what, num, head, tail in (("system", args.system_tokens, wl.SYSTEM_HEAD, wl.END),
                                    ("question", args.question_tokens, wl.USER_HEAD, wl.END + wl.ASSISTANT_HEAD)):
            least = len(pb.enc(head)) + len(pb.enc(tail)) + 1
            if num < least:
                raise SystemExit(f"bench serving: --{what}-tokens must be at least {least} with --endpoint chat "
                                 f"(its role markers take {least - 1} tokens)")
    n = args.num_requests
    prompts = build_prompts(pb, args.groups, n * len(rates) + args.warmup * args.groups, args.system_tokens,
                            args.question_tokens, args.seed)
    warm_prompts: list[Prompt] = []
    for g in range(args.groups):  # warm-up questions: the first ``warmup`` of each group
        warm_prompts += [p for p in prompts if p.group == g][:args.warmup]
    warm_ids = {id(p) for p in warm_prompts}
    rest = [p for p in prompts if id(p) not in warm_ids][:n * len(rates)]
    body = lambda p: (p, request_body(pb, p, args.endpoint, args.output_tokens))  # noqa: E731
    bodies = [[body(p) for p in rest[k * n:(k + 1) * n]] for k in range(len(rates))]
    warmup = [(p, request_body(pb, p, args.endpoint, min(args.output_tokens, 4))) for p in warm_prompts]

    server = None
    t0 = time.time()
    try:
        if base is None:
            serve_args = ["--dtype", args.dtype, *(["--model", args.model] if args.model else []), *args.server_args]
            server = SpawnedServer(serve_args, PROG, args.server_log, args.api_key)
            base = server.wait_ready(args.startup_seconds)
        results, info = asyncio.run(run_all(base, args, rates, bodies, warmup))
    finally:
        exit_code = server.stop() if server is not None else None
    doc = dict(
        workload="serving", command=command,
        params=dict(rates=[rate_label(r) for r in rates], num_requests=n, max_seconds=args.max_seconds,
                    request_timeout=args.request_timeout, endpoint=args.endpoint, groups=args.groups,
                    system_tokens=args.system_tokens, question_tokens=args.question_tokens,
                    output_tokens=args.output_tokens, warmup=args.warmup, seed=args.seed,
                    corpus_sha=pb.stream.digest, temperature=0.0, ignore_eos=True),
        started=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t0)), duration_s=round(time.time() - t0, 1),
        machine=machine, loadavg_start=load0, loadavg_end=_loadavg(),
        server=dict(url=base, spawned=server is not None, command=server.cmd if server else None,
                    model=args.model, dtype=args.dtype if server else None,
                    log=str(server.log_path) if server else None, exit_code=exit_code),
        warmup=info.get("warmup"), results=results,
    )
    stem = args.stem or f"serving-{time.strftime('%Y%m%d-%H%M%S', time.localtime(t0))}"
    path = write_result(doc, args.out, stem)
    png = None
    if not args.no_plot:
        try:
            png = plot_serving(doc, path.with_suffix(".png"))
        except Exception as e:  # a plot must never lose the numbers
            print(f"bench: plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"\nserving  {json.dumps(doc['params'])[:300]}")
    print(table(doc))
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return 0 if all(r["errors"] == 0 for r in results) else 1


# ---------------------------------------------------------------------- report
def _f(v, nd=2, scale=1.0) -> str:
    return "-" if v is None else f"{v * scale:.{nd}f}"


def _p(d: dict | None, scale=1.0, nd=2) -> str:
    if not d:
        return "-"
    return " / ".join(_f(d[f"p{p}"], nd, scale) for p in PERCENTILES)


def row(r: dict, plain: bool = False) -> str:
    cells = [r["rate_label"], f"{r['completed']}/{r['num_requests']}", str(r["errors"]), str(r["not_sent"]),
             _f(r["achieved_rate"]), _f(r["request_throughput"]), _f(r["output_tokens_per_s"], 1),
             _p(r["ttft_s"], nd=3), _p(r["tpot_s"], 1000, 1), _p(r["latency_s"], nd=3),
             _f(r["prefix_hit_fraction"], 3)]
    if plain:
        return (f"done {cells[1]}, errors {cells[2]}, not sent {cells[3]}, out tok/s {cells[6]}, "
                f"TTFT p50/p90/p99 {cells[7]} s, TPOT {cells[8]} ms, latency {cells[9]} s, cache hit {cells[10]}")
    return "| " + " | ".join(cells) + " |"


def table(doc: dict) -> str:
    """Markdown table: one row per rate."""
    rows = ["| rate (req/s) | done | errors | not sent | achieved req/s | finished req/s | out tok/s "
            "| TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | latency p50 / p90 / p99 (s) | cache hit |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    rows += [row(r) for r in doc["results"]]
    return "\n".join(rows)


def plot_serving(doc: dict, path: Path) -> Path:
    """TTFT and TPOT p50/p99, and output tokens/s, against the rate (rates evenly spaced, inf last)."""
    from bench.report import _plt

    plt = _plt()
    res = doc["results"]
    labels = [r["rate_label"] for r in res]
    x = list(range(len(res)))

    def series(key: str, p: str, scale: float = 1.0):
        return [(r[key][p] * scale) if r[key] else float("nan") for r in res]

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, key, scale, unit, title in ((axes[0], "ttft_s", 1.0, "s", "time to first token"),
                                        (axes[1], "tpot_s", 1000.0, "ms", "time per output token")):
        for p, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, series(key, p, scale), style, label=p)
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.legend()
    ax = axes[2]
    ax.plot(x, [r["output_tokens_per_s"] or float("nan") for r in res], "o-", color="tab:green")
    ax.set_ylabel("output tokens / s")
    ax.set_title("throughput")
    for ax in axes:
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
    p = doc["params"]
    fig.suptitle(f"serving: {p['num_requests']} requests per rate, S {p['system_tokens']}, "
                 f"Q {p['question_tokens']}, O {p['output_tokens']} ({p['endpoint']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
