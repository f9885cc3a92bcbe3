"""Sampling parameters (the OpenAI / vLLM set). No torch here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefixkv.structured_outputs import StructuredOutputsParams, structured_outputs_from
from prefixkv.validation import require

_MAX_SEED = 2**63 - 1
# Stop strings are searched in the tail of the text every token: bounded in count and length.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
OUTPUT_KINDS = ("cumulative", "delta", "final_only")
# The longest a prefix may be retained in the cache since its last use (a week; Anthropic's longest is 1 h).
MAX_RETENTION_TTL_S = 7 * 24 * 3600.0
# Temperatures below this are greedy (vLLM's rule): dividing logits by them under- or overflows.
GREEDY_TEMPERATURE = 1e-5


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # not NaN


@dataclass
class SamplingParams:
    """How to sample one request.

    ``temperature`` below 1e-5 (0 included) is exact greedy (argmax). ``logprobs=k`` returns, for every generated
    token, the log-probability of the chosen token and of the ``k`` most likely tokens, taken
    from the model's raw distribution (``log_softmax`` of the logits) *before* penalties,
    temperature and top-k/top-p/min-p are applied.

    ``structured_outputs`` (a ``StructuredOutputsParams`` or its dict form, e.g. ``{"json": schema}``)
    constrains the output to a JSON schema, regex, choice or grammar (prefixkv/structured_outputs.py).

    ``cache_salt`` (vLLM's field) and ``cache_partition`` (the server's, from the API key that
    authenticated the request: never a client's) choose which prefix cache the request shares:
    only requests with both equal hit each other's blocks (kv/keys.py ``cache_root``). They change
    nothing in the outputs.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # logprobs of the prompt's own tokens (each given the ones before it) with this many top
    # alternatives; such a request computes its whole prompt (no prefix-cache hit), as vLLM's
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # False: token ids only, no text (benchmarks, token-id clients); stop strings then cannot apply.
    detokenize: bool = True
    # What LLMEngine.step returns while the request runs (vLLM's RequestOutputKind): "cumulative"
    # (everything so far, every step), "delta" (what is new; the final output has everything), or
    # "final_only" (nothing until it finishes).
    output_kind: str = "cumulative"
    # Streamed outputs ("cumulative" / "delta") go out once a sequence has this many new tokens
    # unsent (more after an accepted speculative draft), and its first token and its finish at once
    # (vLLM's stream_interval): fewer, larger chunks for many streams. With the engine in its own
    # process a stop string is found where the text is made, when the chunk arrives: up to this
    # many tokens later (the output is the same). The engine's own (SchedulerConfig.stream_interval)
    # is the least; None: that one.
    stream_interval: int | None = None
    structured_outputs: StructuredOutputsParams | dict | None = None
    # token id -> a number in [-100, 100] added to its logit before sampling (OpenAI's logit_bias);
    # logprobs stay those of the raw distribution
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    include_stop_str_in_output: bool = False  # a stop string that ends the text is kept in it
    # words never to generate (vLLM's bad_words): each word's tokens, with and without a leading
    # space; a word's last token is banned wherever the output so far ends with the ones before it
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False, compare=False)
    cache_salt: str | None = None
    cache_partition: str | None = None
    # Keep the prompt's first kv_retention_tokens tokens (None: the whole prompt) in the prefix
    # cache for kv_retention_ttl_s seconds since their last use (kv/retention.py); None: no retention.
    kv_retention_ttl_s: float | None = None
    kv_retention_tokens: int | None = None
    # A name for that retention, so that LLMEngine.release_retention(handle) lets it go before its
    # TTL (the server names a stored Response's by the response's id); None: it lapses with its TTL.
    # A handle is kept until released or its prefix lapses: name only what will be released.
    kv_retention_handle: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.structured_outputs = structured_outputs_from(self.structured_outputs)
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        require(_is_int(self.n) and 1 <= self.n <= 128, "n", f"must be an int in [1, 128], got {self.n!r}")
        require(_is_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature",
               f"must be a number in [0, 100], got {self.temperature!r}")
        require(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"must be in (0, 1], got {self.top_p!r}")
        require(_is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0), "top_k",
               f"must be -1 (disabled), 0 (disabled) or a positive int, got {self.top_k!r}")
        require(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"must be in [0, 1], got {self.min_p!r}")
        require(self.seed is None or (_is_int(self.seed) and -_MAX_SEED <= self.seed <= _MAX_SEED), "seed",
               f"must be an int (64-bit) or None, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            require(_is_num(v) and -2.0 <= v <= 2.0, name, f"must be a number in [-2, 2], got {v!r}")
        require(_is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
               "repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty!r}")
        require(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
               "stop", "must be a non-empty string or a list of non-empty strings")
        require(len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        require(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters, got "
               f"{max(map(len, self.stop), default=0)}")
        require(self.output_kind in OUTPUT_KINDS, "output_kind",
               f"must be one of {OUTPUT_KINDS}, got {self.output_kind!r}")
        require(self.stream_interval is None or (_is_int(self.stream_interval) and self.stream_interval >= 1),
                "stream_interval", f"must be a positive int or None, got {self.stream_interval!r}")
        require(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be a list of non-negative ints")
        require(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool")
        require(isinstance(self.skip_special_tokens, bool), "skip_special_tokens", "must be a bool")
        require(self.detokenize or not self.stop, "stop", "stop strings need detokenize=True")
        require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
               f"must be a positive int or None, got {self.max_tokens!r}")
        require(_is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens",
               f"must be a non-negative int, got {self.min_tokens!r}")
        require(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        require(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20), "logprobs",
               f"must be an int in [0, 20] or None, got {self.logprobs!r}")
        require(self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= 20),
               "prompt_logprobs", f"must be an int in [0, 20] or None, got {self.prompt_logprobs!r}")
        for name in ("cache_salt", "cache_partition"):
            v = getattr(self, name)
            require(v is None or (isinstance(v, str) and v), name, f"must be a non-empty string or None, got {v!r}")
        require(self.kv_retention_ttl_s is None or (_is_num(self.kv_retention_ttl_s)
                                                    and 0 < self.kv_retention_ttl_s <= MAX_RETENTION_TTL_S),
                "kv_retention_ttl_s", f"must be a number of seconds in (0, {MAX_RETENTION_TTL_S}] or None, "
                f"got {self.kv_retention_ttl_s!r}")
        require(self.kv_retention_tokens is None or (_is_int(self.kv_retention_tokens) and self.kv_retention_tokens >= 1),
                "kv_retention_tokens", f"must be a positive int or None, got {self.kv_retention_tokens!r}")
        require(self.kv_retention_tokens is None or self.kv_retention_ttl_s is not None, "kv_retention_tokens",
                "needs kv_retention_ttl_s")
        require(self.kv_retention_handle is None or (isinstance(self.kv_retention_handle, str)
                                                     and self.kv_retention_handle), "kv_retention_handle",
                f"must be a non-empty string or None, got {self.kv_retention_handle!r}")
        require(self.kv_retention_handle is None or self.kv_retention_ttl_s is not None, "kv_retention_handle",
                "needs kv_retention_ttl_s")
        if self.structured_outputs is not None:
            require(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
                    "must be a StructuredOutputsParams or a dict of its fields")
            self.structured_outputs.validate()
        if self.logit_bias is not None:
            require(isinstance(self.logit_bias, dict) and all(_is_int(t) and t >= 0 for t in self.logit_bias),
                    "logit_bias", "must map token ids (non-negative ints) to numbers")
            require(all(_is_num(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias",
                    "each bias must be a number in [-100, 100]")
        if self.allowed_token_ids is not None:
            require(isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                    and all(_is_int(t) and t >= 0 for t in self.allowed_token_ids), "allowed_token_ids",
                    "must be a non-empty list of token ids (non-negative ints)")
        require(isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "must be a bool")
        if self.bad_words is not None:
            require(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                    "bad_words", "must be a list of non-empty strings")
            require(len(self.bad_words) <= 256, "bad_words", f"at most 256 words, got {len(self.bad_words)}")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if t >= vocab_size]
            require(not bad, "stop_token_ids", f"ids {bad} are outside the vocabulary (size {vocab_size})")
            for name in ("logit_bias", "allowed_token_ids"):
                bad = sorted(t for t in (getattr(self, name) or ()) if t >= vocab_size)
                require(not bad, name, f"ids {bad[:8]} are outside the vocabulary (size {vocab_size})")

    def tokenize_bad_words(self, encode) -> None:
        """Fill ``bad_words_token_ids`` with ``encode(text) -> ids`` (no special tokens)."""
        seqs: list[list[int]] = []
        for word in self.bad_words or ():
            for text in (word.lstrip(), " " + word.lstrip()):
                ids = encode(text)
                if ids and ids not in seqs:
                    seqs.append(ids)
        self.bad_words_token_ids = seqs

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


# generation_config.json keys -> SamplingParams fields (vLLM's --generation-config auto takes these)
_GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_defaults(directory: str | None) -> dict:
    """The sampling defaults a model ships in ``directory/generation_config.json`` (the keys of
    ``_GENERATION_CONFIG_KEYS`` it sets, under SamplingParams' names), as vLLM's
    ``--generation-config auto`` uses them: for the fields a request leaves unset. {} if none;
    a value SamplingParams would refuse is a ValueError naming the file's key."""
    import json
    import os

    if directory is None:
        return {}
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    out = {field: doc[key] for key, field in _GENERATION_CONFIG_KEYS.items() if doc.get(key) is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    return out

