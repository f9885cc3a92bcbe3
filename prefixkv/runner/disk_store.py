"""The disk tier's files: one per KV block, in ``<dir>/<fingerprint>/``.

The fingerprint (``kv_fingerprint``) hashes what makes a block's KV valid: the model's config,
its weight files (names, sizes and their first and last MiB), the dtype, the block size, the
per-block KV shape and ``FORMAT_VERSION``; a directory written by anything else is never read.

A file: ``MAGIC``, then a header (block hash, block size, payload bytes, CRC-32 of the payload),
the block's tokens (int64), then the payload (all layers' K and V of the block, the KV cache's
dtype). Written to a temporary name and renamed, so a process killed mid-write leaves at most a
``.tmp`` file, which the next start deletes. ``scan`` (at start) reads every file whole and keeps
only those whose header, size, tokens and checksum agree; ``read`` checks the checksum again and
raises ``DiskKVError`` on a mismatch (the engine then fails the step's requests rather than
attend over wrong KV).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1
MAGIC = b"PKVBLK1\n"
_HEADER = struct.Struct("<qiqI")  # block hash, block size, payload bytes, crc32


class DiskKVError(RuntimeError):
    def __init__(self, message: str, key: int) -> None:
        super().__init__(message)
        self.key = key  # the block whose file failed


def kv_fingerprint(model_path: Path, dtype: torch.dtype, block_size: int, block_shape: tuple[int, ...]) -> str:
    h = hashlib.sha256()
    p = Path(model_path)
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    for f in files:
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            size = f.stat().st_size
            h.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 20))
                fh.seek(max(0, size - (1 << 20)))
                h.update(fh.read(1 << 20))
    h.update(json.dumps([FORMAT_VERSION, str(dtype), block_size, list(block_shape)]).encode())
    return h.hexdigest()[:24]


class DiskKVStore:
    def __init__(self, root: str | os.PathLike, fingerprint: str, block_size: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        self.dir = Path(root) / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.block_size = block_size
        self.block_shape = block_shape  # [num_layers, 2, KVH, block_size, D]
        self.dtype = dtype
        self.payload_bytes = int(np.prod(block_shape)) * torch.empty((), dtype=dtype).element_size()
        self.num_bytes_written = 0
        self.num_bytes_read = 0
        self.num_discarded = 0  # files found invalid (truncated, corrupt, foreign) and deleted

    def _path(self, key: int) -> Path:
        return self.dir / f"{key & 0xFFFFFFFFFFFFFFFF:016x}.kvb"

    def write(self, key: int, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        payload = block.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        assert len(payload) == self.payload_bytes, (len(payload), self.payload_bytes)
        header = _HEADER.pack(key, len(tokens), len(payload), zlib.crc32(payload))
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(MAGIC + header + np.asarray(tokens, dtype=np.int64).tobytes() + payload)
        os.replace(tmp, path)
        self.num_bytes_written += len(payload)

    def read(self, key: int) -> torch.Tensor:
        """The block's KV, [num_layers, 2, KVH, block_size, D]; DiskKVError if the file is not
        what was written."""
        try:
            data = self._path(key).read_bytes()
        except OSError as e:
            raise DiskKVError(f"disk KV block {key:x}: {e}", key) from None
        parsed = self._parse(data)
        if parsed is None or parsed[0] != key:
            raise DiskKVError(f"disk KV block {key:x}: the file is corrupt", key)
        self.num_bytes_read += self.payload_bytes
        raw = torch.frombuffer(bytearray(parsed[2]), dtype=torch.uint8)
        return raw.view(self.dtype).view(self.block_shape)

    def delete(self, key: int) -> None:
        self._path(key).unlink(missing_ok=True)

    def _parse(self, data: bytes) -> tuple[int, tuple[int, ...], bytes] | None:
        n0 = len(MAGIC) + _HEADER.size
        if len(data) < n0 or not data.startswith(MAGIC):
            return None
        key, ntok, nbytes, crc = _HEADER.unpack_from(data, len(MAGIC))
        if ntok != self.block_size or nbytes != self.payload_bytes or len(data) != n0 + 8 * ntok + nbytes:
            return None
        payload = data[n0 + 8 * ntok:]
        if zlib.crc32(payload) != crc:
            return None
        tokens = tuple(np.frombuffer(data, dtype=np.int64, count=ntok, offset=n0).tolist())
        return key, tokens, payload

    def scan(self) -> list[tuple[int, tuple[int, ...]]]:
        """(key, tokens) of every valid file, oldest first; invalid files and leftover temporary
        files are deleted."""
        found = []
        for path in sorted(self.dir.iterdir(), key=lambda q: q.stat().st_mtime):
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
                continue
            parsed = self._parse(path.read_bytes()) if path.suffix == ".kvb" else None
            if parsed is None or path != self._path(parsed[0]):
                path.unlink(missing_ok=True)
                self.num_discarded += 1
                continue
            found.append((parsed[0], parsed[1]))
        return found
