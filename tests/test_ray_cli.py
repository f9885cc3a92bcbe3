"""``prefixkv serve`` on Ray Serve from the command line: the flags, and one real run — a local Ray
instance started by the command, Serve's autoscaling from one replica to two under load, SIGTERM
ending it with status 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("ray.serve")

from prefixkv.cli import build_parser, uses_ray  # noqa: E402
from prefixkv.serve.app import autoscaling_from_args, build_app  # noqa: E402


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_the_package_and_the_cli_import_no_ray():
    code = ("import sys, prefixkv, prefixkv.cli, prefixkv.serve; print(sorted(m for m in ('ray', 'aiohttp', 'zmq', "
            "'msgspec', 'cupy', 'starlette', 'llguidance') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_replica_flags_select_ray_and_build_the_autoscaling_config(tmp_path):
    assert not uses_ray(_args())
    assert uses_ray(_args("--replicas", "2")) and uses_ray(_args("--ray-address", "auto"))
    assert autoscaling_from_args(_args("--replicas", "2")) is None
    assert autoscaling_from_args(_args("--min-replicas", "1", "--max-replicas", "3", "--target-ongoing-requests",
                                       "4")) == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4.0}
    assert autoscaling_from_args(_args("--replicas", "3", "--target-ongoing-requests", "2")) == {
        "min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 2.0}
    assert uses_ray(_args("--target-ongoing-requests", "2"))
    f = tmp_path / "as.json"
    f.write_text(json.dumps({"min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 0.5}))
    assert autoscaling_from_args(_args("--autoscaling-config", str(f)))["upscale_delay_s"] == 0.5
    # flags override the file's fields, the file's others stay
    assert autoscaling_from_args(_args("--autoscaling-config", str(f), "--max-replicas", "4")) == {
        "min_replicas": 1, "max_replicas": 4, "upscale_delay_s": 0.5}
    f.write_text(json.dumps({"min_replicas": 3, "max_replicas": 2}))
    with pytest.raises(ValueError, match="autoscaling_config"):
        autoscaling_from_args(_args("--autoscaling-config", str(f)))
    f.write_text("[1]")
    with pytest.raises(ValueError, match="autoscaling_config: the file must hold a JSON object"):
        autoscaling_from_args(_args("--autoscaling-config", str(f)))
    with pytest.raises(ValueError, match="router: must be one of"):
        build_app(router="random")
    with pytest.raises(ValueError, match="replicas: must be >= 1"):
        build_app(num_replicas=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url: str) -> dict:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # 503 until a replica has published its stats
        return json.loads(e.read())
    except (urllib.error.URLError, ConnectionError):
        return {}


def test_serve_replicas_autoscales_under_load_and_stops_on_sigterm(one_ray_instance, tiny_llama, tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    conf = tmp_path / "autoscaling.json"
    conf.write_text(json.dumps({"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                "upscale_delay_s": 0.5, "metrics_interval_s": 0.5, "look_back_period_s": 1.0}))
    cmd = [sys.executable, "-m", "prefixkv.cli", "serve", "--model", str(tiny_llama), "--dtype", "float64",
           "--port", str(port), "--served-model-name", "tiny", "--autoscaling-config", str(conf),
           "--num-cpus-per-replica", "0.5", "--num-kv-blocks", "256", "--routing-stats-period", "0.3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        end = time.monotonic() + 180
        while not any("prefixkv serving tiny at" in line for line in lines):
            assert proc.poll() is None and time.monotonic() < end, "".join(lines[-30:])
            time.sleep(0.2)
        assert len(_health(url).get("replicas", {})) <= 1

        stop = threading.Event()

        def load() -> None:  # back-to-back requests keep several in flight
            body = json.dumps({"model": "tiny", "prompt": "load", "max_tokens": 48, "temperature": 0,
                               "ignore_eos": True}).encode()
            while not stop.is_set():
                req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    assert r.status == 200

        workers = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for w in workers:
            w.start()
        while len(_health(url).get("replicas", {})) < 2:
            assert time.monotonic() < end, "Serve did not scale to two replicas"
            time.sleep(0.3)
        stop.set()
        for w in workers:
            w.join(120)
        req = urllib.request.Request(url + "/v1/completions", json.dumps(
            {"model": "tiny", "prompt": "after", "max_tokens": 3}).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, "".join(lines[-30:])
