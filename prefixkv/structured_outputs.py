"""Structured outputs: a request's tokens constrained to a JSON schema, a regex, a choice of strings
or a grammar, through llguidance (imported only when a request asks for one).

Why llguidance (issue 18): it is a 3 MB wheel with no dependencies that computes a token mask
lazily from an Earley parser over the tokenizer's trie (~8 us a row for SmolLM2's 49,152 tokens,
``python -m bench.structured``; no ahead-of-time grammar compilation, so no schema stalls the
engine); xgrammar 0.2.8 pulls in triton (~1 GB) on Linux for its GPU path. vLLM and SGLang use
both (xgrammar by default). Measured side by side (``python -m bench.grammar_libs``, RESULTS.md):
xgrammar fills a row's mask 8x faster (1.9 vs 15 us) but compiles a schema 200x slower (146 vs
0.7 ms); at this CPU's step times llguidance costs less overall.

How it runs:

- ``GrammarCompiler.compile`` turns ``StructuredOutputsParams`` into an llguidance grammar and
  validates it against the tokenizer when the request is added (``LLMEngine.prepare_request``,
  off the engine step in the server: it runs in the tokenizer thread pool); an invalid schema,
  regex or grammar is a ValueError naming the field (HTTP 400). Grammars are cached by their text.
- each sequence of a constrained request has its own ``LLMatcher`` (``Request.matcher``; n > 1
  children get copies at the fork). Before sampling, the runner fills a token bitmask for the
  constrained rows only (``fill_bitmask``) and the sampler sets every disallowed logit to -inf;
  logprobs stay those of the raw distribution, as for every other request.
- the output processor feeds every new token to the matcher; when the grammar is complete the
  sequence finishes with ``finish_reason="stop"`` (or with eos, which the mask allows only then).
- preemption keeps a sequence's output tokens, so its matcher stays valid; prefix caching does
  not touch it. Constrained requests do not draft speculative tokens (``Request.can_speculate``).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from prefixkv.validation import require

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_CACHE_SIZE = 256
MAX_GRAMMAR_CHARS = 1 << 20


@dataclass
class StructuredOutputsParams:
    """Exactly one of: ``json`` (a JSON schema, dict or str), ``json_object=True`` (any JSON
    object), ``regex``, ``choice`` (list of strings) or ``grammar`` (Lark, or GBNF/EBNF as in
    llama.cpp). vLLM's ``StructuredOutputsParams`` under the same names."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        set_ = [k for k in _KINDS if (getattr(self, k) not in (None, False))]
        require(len(set_) == 1, "structured_outputs",
                f"set exactly one of {', '.join(_KINDS)} (got {', '.join(set_) or 'none'})")
        require(isinstance(self.json_object, bool), "structured_outputs.json_object", "must be a bool")
        if self.json is not None:
            require(isinstance(self.json, (dict, str)), "structured_outputs.json",
                    "must be a JSON schema (an object, or a string holding one)")
            if isinstance(self.json, str):
                try:
                    doc = json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"structured_outputs.json: not valid JSON ({e})") from None
                require(isinstance(doc, (dict, bool)), "structured_outputs.json", "must be a JSON schema object")
        if self.regex is not None:
            require(isinstance(self.regex, str) and self.regex, "structured_outputs.regex",
                    "must be a non-empty string")
        if self.choice is not None:
            require(isinstance(self.choice, list) and self.choice and all(isinstance(c, str) and c for c in self.choice),
                    "structured_outputs.choice", "must be a non-empty list of non-empty strings")
        if self.grammar is not None:
            require(isinstance(self.grammar, str) and self.grammar.strip(), "structured_outputs.grammar",
                    "must be a non-empty string")
        require(len(self.source()[1]) <= MAX_GRAMMAR_CHARS, f"structured_outputs.{self.kind}",
                f"at most {MAX_GRAMMAR_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def source(self) -> tuple[str, str]:
        """(llguidance format, text): the cache key and what ``grammar_from`` takes."""
        k = self.kind
        if k == "json":
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order = output order
            return "json_schema", text
        if k == "json_object":
            return "json_schema", '{"type": "object"}'
        if k == "regex":
            return "regex", self.regex
        if k == "choice":
            return "choice", json.dumps(self.choice)
        return "grammar", self.grammar


def structured_outputs_from(value: Any) -> StructuredOutputsParams | None:
    """A dict (the wire / offline form) or a ``StructuredOutputsParams`` -> params (ValueError
    naming the field for an unknown key)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    require(isinstance(value, dict), "structured_outputs", "must be an object")
    unknown = sorted(set(value) - set(_KINDS))
    require(not unknown, f"structured_outputs.{unknown[0] if unknown else ''}",
            f"unknown field (known: {', '.join(_KINDS)})")
    return StructuredOutputsParams(**value)


class GrammarCompiler:
    """Grammars for one tokenizer: compiled, validated, cached; matchers built from them.
    Thread-safe (``compile`` runs in the server's tokenizer threads)."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    import llguidance.hf
                except ImportError as e:
                    raise ValueError("structured_outputs: needs the llguidance package "
                                     "(pip install 'prefixkv[structured]')") from e
                hf = getattr(self._tokenizer, "hf", None)
                if hf is None:
                    raise ValueError("structured_outputs: needs a Hugging Face fast tokenizer (tokenizer.json); "
                                     "this model has a raw sentencepiece one")
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    hf, n_vocab=self._vocab_size, eos_token=list(self._tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The validated llguidance grammar for ``params`` (ValueError naming the field)."""
        key = params.source()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        import llguidance

        tok = self.ll_tokenizer
        field = f"structured_outputs.{params.kind}"
        try:
            grammar = llguidance.grammar_from(*key)
        except ValueError as e:
            raise ValueError(f"{field}: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise ValueError(f"{field}: invalid: {' '.join(messages[0].split())}")  # one line
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, params: StructuredOutputsParams):
        import llguidance

        m = llguidance.LLMatcher(self.ll_tokenizer, self.compile(params))
        if m.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: invalid: {m.get_error()}")
        return m


def fill_bitmask(matchers: list, vocab_size: int):
    """Allowed-token masks of the given matchers: bool [len(matchers), vocab_size] (numpy)."""
    import numpy as np

    words = (vocab_size + 31) // 32
    bits = np.zeros((len(matchers), words), dtype=np.int32)
    for i, m in enumerate(matchers):
        m.unsafe_compute_mask_ptr(bits[i].ctypes.data, words * 4)
    return np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size].view(bool)


class StructuredOutputError(RuntimeError):
    """A constrained sequence's matcher refused a token (cannot happen with the mask applied)."""
