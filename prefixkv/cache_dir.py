"""Where prefixkv keeps what it derives once per machine (converted GGUF models, built CPU kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("PREFIXKV_CACHE_DIR") or Path.home() / ".cache" / "prefixkv")
