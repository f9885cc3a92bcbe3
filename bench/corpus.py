"""Real English text for prompts, tokenized once: the docstrings of a fixed list of standard-library
modules (present wherever Python is, nothing downloaded). Prompts are windows of this token stream,
so their lengths are exact whatever the tokenizer."""

from __future__ import annotations

import hashlib
import importlib
import inspect
import warnings
from dataclasses import dataclass

MODULES = (
    "collections", "json", "argparse", "logging", "unittest", "asyncio", "itertools", "functools",
    "pathlib", "subprocess", "threading", "random", "statistics", "datetime", "decimal", "fractions",
    "heapq", "bisect", "textwrap", "string", "re", "csv", "sqlite3", "email.message", "http.client",
    "urllib.request", "zipfile", "tarfile", "shutil", "os", "typing", "dataclasses", "enum",
    "contextlib", "inspect",
)


def corpus_paragraphs() -> list[str]:
    """Module and public class/function docstrings (longer than 200 characters), in a fixed order."""
    with warnings.catch_warnings():  # getdoc on deprecated aliases (typing.io) warns
        warnings.simplefilter("ignore")
        return _paragraphs()


def _paragraphs() -> list[str]:
    parts: list[str] = []
    for name in MODULES:
        mod = importlib.import_module(name)
        doc = inspect.getdoc(mod)
        if doc:
            parts.append(doc)
        for key, obj in sorted(vars(mod).items()):
            if key.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    parts.append(doc)
    return parts


@dataclass
class TokenStream:
    """The corpus as one run of token ids; ``take(n)`` hands out consecutive, non-overlapping
    windows (wrapping around), so two prompts never share a prefix by accident."""

    ids: list[int]
    digest: str
    pos: int = 0

    @classmethod
    def build(cls, tokenizer, min_tokens: int = 0) -> "TokenStream":
        ids: list[int] = []
        for para in corpus_paragraphs():
            ids.extend(tokenizer.encode(para + "\n\n", add_special_tokens=False))
        if not ids:
            raise ValueError("corpus: the tokenizer produced no tokens")
        while len(ids) < min_tokens:
            ids = ids + ids
        digest = hashlib.sha256(repr(ids).encode()).hexdigest()[:12]
        return cls(ids, digest)

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self.pos >= len(self.ids):
                self.pos = 0
            k = min(n - len(out), len(self.ids) - self.pos)
            out.extend(self.ids[self.pos:self.pos + k])
            self.pos += k
        return out
