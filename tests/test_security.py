"""Security properties of the server and the loader.

- ``prefixkv serve`` binds 127.0.0.1 by default (the argparse default, and the socket it really
  listens on, read from /proc).
- The API key check cannot be bypassed by any route, method, path spelling or header trick: a request
  without the right key never reaches the engine (no ``add_request`` and no tokenizer work on the
  engine thread; engine stats unchanged), and never gets a 2xx.
- Weights load from safetensors or GGUF; a ``pytorch_model.bin`` whose unpickling would run code is
  refused by ``torch.load(weights_only=True)`` and the code never runs. Nor does Python code that a
  model directory names in ``auto_map`` (``trust_remote_code`` stays off).
"""

from __future__ import annotations

import base64
import builtins
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from prefixkv.async_engine import AsyncEngine
from prefixkv.config import CacheConfig, EngineConfig
from prefixkv.engine import LLMEngine
from prefixkv.server.app import BackgroundServer, ServerConfig

MODEL = "tiny"
KEY = "k3y-Secret_42"


# ---------------------------------------------------------------------- loopback bind
def test_cli_default_host_is_loopback(monkeypatch):
    import prefixkv.cli
    import prefixkv.server.app

    seen = {}

    def fake_run_server(engine_config, server_config, host, port, **kw):
        seen.update(host=host, api_key=server_config.api_key)
        return 0

    monkeypatch.delenv("PREFIXKV_API_KEY", raising=False)
    monkeypatch.setattr(prefixkv.server.app, "run_server", fake_run_server)
    assert prefixkv.cli.main(["serve"]) == 0
    assert seen["host"] == "127.0.0.1"
    assert seen["api_key"] is None  # no key unless asked for (PREFIXKV_API_KEY also works)
    assert BackgroundServer.__dataclass_fields__["host"].default == "127.0.0.1"


def _listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process ``pid`` holds."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        except OSError:
            continue
        if m:
            inodes.add(m.group(1))
    out = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            if size == 4:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                addr = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            out.append((addr, int(hex_port, 16)))
    return out


def test_serve_listens_only_on_loopback(tiny_llama):
    proc = subprocess.Popen([sys.executable, "-m", "prefixkv.cli", "serve", "--model", str(tiny_llama), "--port", "0",
                             "--num-kv-blocks", "32"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        line = ""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line or "serving" in line:
                break
        m = re.search(r"at http://127\.0\.0\.1:(\d+)$", line.strip())
        assert m, f"no ready line: {line!r}"
        port = int(m.group(1))
        assert _listening_addresses(proc.pid) == [("127.0.0.1", port)]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


# ---------------------------------------------------------------------- the API key
class CountingEngine(AsyncEngine):
    """Counts every way a request reaches the engine: add_request(s), and work run on the engine
    thread."""

    num_calls = 0

    async def add_request(self, *args, **kwargs):
        self.num_calls += 1
        return await super().add_request(*args, **kwargs)

    async def add_requests(self, *args, **kwargs):
        self.num_calls += 1
        return await super().add_requests(*args, **kwargs)

    async def run(self, fn):
        self.num_calls += 1
        return await super().run(fn)


@pytest.fixture(scope="module")
def keyed_server(tiny_llama):
    engine = CountingEngine(LLMEngine(EngineConfig(model=str(tiny_llama), cache=CacheConfig(num_kv_blocks=64))))
    with BackgroundServer(engine, ServerConfig(MODEL, api_key=KEY)) as srv:
        yield srv


def raw_request(srv, method: str, target: str, headers: list[tuple[str, str]], body: bytes = b"") -> tuple[int, bytes]:
    """One request sent byte for byte (no client-side normalization of the path or the headers)."""
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    lines = [f"{method} {target} HTTP/1.1", "Host: 127.0.0.1", "Connection: close",
             f"Content-Length: {len(body)}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in headers]
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    resp = b"".join(chunks)
    status = int(resp.split(b" ", 2)[1])
    return status, resp.partition(b"\r\n\r\n")[2]


CHAT_BODY = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
COMPL_BODY = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
TRICKY_PATHS = [
    "/v1/models", "/v1/models/tiny", "/v1/chat/completions", "/v1/completions", "/v1",
    "/v1/", "/v1/models/", "/v1/chat/completions/", "/v1//chat/completions", "//v1/chat/completions",
    "/v1/./completions", "/./v1/completions", "/v1/../v1/completions", "/x/../v1/completions",
    "/health/../v1/completions", "/metrics/../v1/chat/completions", "/v1/completions/.", "/v1/completions/..",
    "/V1/completions", "/v1/COMPLETIONS", "/%761/completions", "/%76%31/chat/completions",
    "/v1%2Fcompletions", "/v1/chat%2Fcompletions", "/%2Fv1/completions", "/v1/completions%00",
    "/v1/completions%20", "/v1/completions;x=1", "/v1/completions#frag", "/v1/%2e%2e/v1/completions",
    "/v1/completions?api_key=" + KEY, "/v1/chat/completions?key=" + KEY + "&authorization=Bearer%20" + KEY,
    "http://127.0.0.1/v1/completions", "/health?next=/v1/completions", "/v1/models/%2e%2e",
]
METHODS = ["GET", "POST", "HEAD", "OPTIONS", "PUT", "PATCH", "DELETE", "TRACE"]
OPEN_ROUTES = {"/health", "/metrics"}  # open by design (load balancers, Prometheus)
# (Leading or trailing spaces around the whole value are not in the list: HTTP strips them, so
# "Bearer KEY " *is* the right key.)
WRONG_AUTH = [
    [], [("Authorization", "Bearer wrong")], [("Authorization", f"bearer {KEY}")],
    [("Authorization", f"BEARER {KEY}")], [("Authorization", f"Bearer  {KEY}")],
    [("Authorization", f"Bearer\t{KEY}")], [("Authorization", KEY)], [("Authorization", f"Bearer {KEY}x")],
    [("Authorization", f"Bearer {KEY[:-1]}")], [("Authorization", f"Bearer {KEY.upper()}")],
    [("Authorization", f"Token {KEY}")], [("Authorization", f"Basic {base64.b64encode(KEY.encode()).decode()}")],
    [("Authorization", f"Basic {base64.b64encode(f'user:{KEY}'.encode()).decode()}")],
    [("Authorization", "Bearer")], [("Authorization", "")], [("X-API-Key", "wrong")], [("X-API-Key", f"Bearer {KEY}")],
    [("X-API-Key", KEY.upper())], [("Api-Key", KEY)],
    [("Proxy-Authorization", f"Bearer {KEY}")], [("Authorization", f"Bearer {KEY}\x0b")],
    [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")],
    [("Authorization", f"Bearer {KEY},Bearer wrong")],
]


def _body_for(target: str) -> bytes:
    return CHAT_BODY if "chat" in target else COMPL_BODY


def test_api_key_cannot_be_bypassed(keyed_server):
    srv, engine = keyed_server, keyed_server.engine
    right = [("Authorization", f"Bearer {KEY}")]
    # With the right key: which (method, path) pairs reach a handler at all (2xx)?
    reachable = set()
    for path in TRICKY_PATHS:
        for method in METHODS:
            status, _ = raw_request(srv, method, path, right, _body_for(path) if method != "GET" else b"")
            assert status < 500, (method, path, status)
            if 200 <= status < 300:
                reachable.add((method, path))
    assert ("POST", "/v1/completions") in reachable and ("GET", "/v1/models") in reachable
    # Anthropic's header carries the same key (the anthropic SDK sends it), on every route
    assert raw_request(srv, "POST", "/v1/completions", [("X-API-Key", KEY)], COMPL_BODY)[0] == 200
    assert engine.num_calls > 0  # the counter sees requests that do get in

    _wait_idle(engine)
    calls, stats = engine.num_calls, engine.stats()
    statuses: dict[int, int] = {}
    for path in TRICKY_PATHS:
        for method in METHODS:
            for auth in ([], [("Authorization", "Bearer wrong")]):
                status, body = raw_request(srv, method, path, auth, _body_for(path))
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500, (method, path, auth, status, body[:200])
                if 200 <= status < 300:  # only the open routes answer without a key
                    assert path.split("?")[0] in OPEN_ROUTES, (method, path, auth, status, body[:200])
                    continue
                if (method, path) in reachable:
                    assert status == 401, (method, path, auth, status, body[:200])
                    if method != "HEAD":
                        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    for auth in WRONG_AUTH:
        for method, path in [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")]:
            status, body = raw_request(srv, method, path, auth, _body_for(path))
            assert status in (400, 401), (auth, method, path, status, body[:200])
            if status == 401:  # (a 400 from aiohttp's parser quotes the bad header line to its sender)
                assert KEY.encode() not in body
    assert engine.num_calls == calls, "a request without the right key reached the engine"
    assert engine.stats() == stats
    assert set(statuses) <= {200, 400, 401, 404, 405}, statuses


def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    """Until nothing runs or waits and the statistics (a snapshot of the engine thread's last step)
    stay the same over 0.2 s: a request whose client left may still be admitted, then aborted."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        st = engine.stats()
        if not (st["num_running"] or st["num_waiting"] or st["num_kv_blocks_used"]) and st == last:
            return
        assert time.monotonic() < deadline, st
        last = st
        time.sleep(0.2)


def test_open_routes_do_not_leak_the_key(keyed_server):
    for path in ["/health", "/metrics"]:
        status, body = raw_request(keyed_server, "GET", path, [])
        assert status == 200 and KEY.encode() not in body


# ---------------------------------------------------------------------- no code from model files
class _Evil:
    """Unpickling this creates ``marker`` (a stand-in for arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (builtins.open, (str(self.marker), "w"))


def _model_dir_without_weights(tiny_llama: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in tiny_llama.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, dst / f.name)
    return dst


def _write_evil_bin(path: Path, marker: Path, fmt: str) -> None:
    state = {"model.embed_tokens.weight": _Evil(marker)}
    if fmt == "torch-zip":
        torch.save(state, path)
    else:  # a plain pickle stream (torch's legacy format), protocol 2 as torch.load expects
        path.write_bytes(pickle.dumps(state, protocol=2))


@pytest.fixture(params=["torch-zip", "legacy-pickle"])
def evil_model(request, tiny_llama, tmp_path) -> tuple[Path, Path]:
    marker = tmp_path / "pwned"
    model = _model_dir_without_weights(tiny_llama, tmp_path / "evil-model")
    _write_evil_bin(model / "pytorch_model.bin", marker, request.param)
    pickle.loads(pickle.dumps(_Evil(marker)))  # the payload works when unpickled the unsafe way
    assert marker.exists()
    marker.unlink()
    return model, marker


def test_malicious_pickle_is_refused_not_executed(evil_model):
    model, marker = evil_model
    with pytest.raises(Exception, match=r"(?i)weights.only|unsupported|pytorch_model\.bin") as exc:
        LLMEngine(EngineConfig(model=str(model), cache=CacheConfig(num_kv_blocks=8)))
    assert not marker.exists(), "the pickle's code ran"
    assert "weights" in str(exc.value).lower() or "pytorch_model.bin" in str(exc.value)
    if model.joinpath("pytorch_model.bin").read_bytes()[:2] == b"PK":  # once is enough for the CLI
        proc = subprocess.run([sys.executable, "-m", "prefixkv.cli", "generate", "--model", str(model), "hi",
                               "--max-tokens", "1", "--num-kv-blocks", "8"], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode != 0 and not marker.exists(), proc.stderr[-2000:]


def test_malicious_pickle_error_is_clear(evil_model):
    model, marker = evil_model
    with pytest.raises(ValueError, match=r"^model: .*pytorch_model\.bin"):
        LLMEngine(EngineConfig(model=str(model), cache=CacheConfig(num_kv_blocks=8)))
    proc = subprocess.run([sys.executable, "-m", "prefixkv.cli", "generate", "--model", str(model), "hi",
                           "--max-tokens", "1", "--num-kv-blocks", "8"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "prefixkv: error: model:" in proc.stderr
    assert not marker.exists()


def test_remote_code_in_model_dir_is_never_imported(tiny_llama, tmp_path):
    """auto_map entries pointing at Python files in the model directory are ignored (no
    trust_remote_code): the model and tokenizer load with transformers' own classes."""
    marker = tmp_path / "pwned"
    model = tmp_path / "remote-code-model"
    shutil.copytree(tiny_llama, model)
    payload = f"open({str(marker)!r}, 'w').close()\n"
    (model / "evil_config.py").write_text(payload + "from transformers import LlamaConfig\n"
                                          "class EvilConfig(LlamaConfig):\n    pass\n")
    (model / "evil_tokenizer.py").write_text(payload + "from transformers import PreTrainedTokenizerFast\n"
                                             "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    cfg = json.loads((model / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil_config.EvilConfig", "AutoModelForCausalLM": "evil_config.EvilConfig"}
    (model / "config.json").write_text(json.dumps(cfg))
    tok_cfg = json.loads((model / "tokenizer_config.json").read_text())
    tok_cfg["auto_map"] = {"AutoTokenizer": ["evil_tokenizer.EvilTokenizer", "evil_tokenizer.EvilTokenizer"]}
    (model / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    try:
        engine = LLMEngine(EngineConfig(model=str(model), cache=CacheConfig(num_kv_blocks=8)))
    except Exception as e:  # refusing the directory is fine too; running its code is not
        assert not marker.exists(), f"remote code ran (and then: {e!r})"
        return
    assert not marker.exists(), "remote code from the model directory ran"
    assert type(engine.runner.hf_config).__name__ == "LlamaConfig"
