"""Shared fixtures: tiny random-weight models of each supported architecture, saved with
``save_pretrained`` and loaded back through prefixkv's real loader; a tiny byte-level BPE
tokenizer trained on the fly. Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tiny_models import build_model, build_tokenizer  # noqa: E402

# Modules that `make test` runs after the rest, one test at a time: they start Ray clusters or wait
# on a server's reaction within a deadline, so a busy neighbour must not share the cores. The rest
# runs side by side in two pytest-xdist workers (`-n 2 --dist loadfile -m "not serial"`).
SERIAL_MODULES = {"test_ray_serve.py", "test_ray_cli.py", "test_ray_ingress.py", "test_ray_routing.py", "test_ray_events.py",
                  "test_faults.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL_MODULES:
            item.add_marker(pytest.mark.serial)


# An engine built here without a KV budget of its own gets 256 MiB, not the CPU default of 1 GiB:
# enough for every such test's requests (a tiny model's token is a few KB, SmolLM2's 46 KB), and the
# cache is zeroed (its pages first touched) at start-up, on some VMs at 15-25 ms of CPU a 2 MB huge page
# (memory the host backs only when the guest first touches it): 1 GiB took 5-10 s an engine there.
import prefixkv.runner.model_runner as _model_runner  # noqa: E402

_model_runner.CPU_KV_CACHE_BYTES = 256 << 20

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest-xdist (`make test`: -n 2 --dist loadfile): a thread per core
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    return path


def _model_dir(tmp_path_factory, tokenizer_dir: Path, arch: str) -> Path:
    import shutil

    path = tmp_path_factory.mktemp(f"tiny-{arch}")
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, path / f.name)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    build_model(path, arch, vocab)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "llama")


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "qwen3")


@pytest.fixture(scope="session")
def tiny_mistral_window(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "mistral-window")


@pytest.fixture(scope="session")
def tiny_gemma2(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "gemma2")


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "gemma3")


@pytest.fixture(scope="session")
def tiny_phi3(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "phi3")


@pytest.fixture(scope="session")
def tiny_phi3_longrope(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "phi3-longrope")


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory, tokenizer_dir) -> Path:
    return _model_dir(tmp_path_factory, tokenizer_dir, "qwen3-moe")




@pytest.fixture(scope="module")
def one_ray_instance():
    """Held by a module that starts Ray (a local instance or a Cluster): under pytest-xdist such
    modules run one after another, never two Ray instances on this machine at once."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / "prefixkv-tests-ray.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
