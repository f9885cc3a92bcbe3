"""Request state shared by the scheduler and the engine. No torch here.

One ``Request`` is one sequence being generated. A user request with ``n > 1`` starts as one
sequence (sample 0) that prefills the prompt; when the prompt is done, the scheduler forks it
into ``n`` sequences that share the prompt's blocks (``seq_id``: ``seq_id_of(request_id, k)``).

Token bookkeeping (``token_ids`` = prompt + output so far)::

    |<------------- num_tokens ------------->|
    | computed (KV written) | to schedule     |
    |<- num_computed_tokens ->|
    |<- cached ->|  (num_cached_tokens: the part of the prompt found in the prefix cache)

A request is prefilling only because ``num_computed_tokens < num_tokens - 1``; a decoding
request has exactly one uncomputed token, the one it sampled last.
"""

from __future__ import annotations

import enum
from array import array

from prefixkv.kv.keys import cache_root
from prefixkv.sampling_params import SamplingParams


def seq_id_of(request_id: str, sample_index: int) -> str:
    """The id of sample ``sample_index`` of a request (its sequence in the scheduler)."""
    return f"{request_id}#{sample_index}"


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


class Request:
    __slots__ = (
        "seq_id", "request_id", "sample_index", "num_prompt_tokens", "token_ids", "sampling_params",
        "num_computed_tokens", "num_cached_tokens", "status", "arrival_order", "wait_start_step",
        "num_preemptions", "seed", "logprobs", "needs_fork", "ngram", "matcher", "block_hashes",
        "cache_root",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        arrival_order: int,
        seed: int,
        sample_index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.sample_index = sample_index
        self.seq_id = seq_id_of(request_id, sample_index)
        # prompt + output: an int64 array, not a list, so the garbage collector never walks a
        # request's tokens (a list's every element is visited by each full collection: at 256
        # requests of 32k tokens that was a 0.2 s pause every ~70 steps, tests/test_scale.py)
        self.token_ids = array("q", prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.sampling_params = sampling_params
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_order = arrival_order
        self.wait_start_step = 0  # the scheduler's step count when it last entered the waiting queue
        self.num_preemptions = 0
        self.seed = seed
        # One entry per output token: (chosen_logprob, [(token_id, logprob), ...], chosen's rank) when requested.
        self.logprobs: list[tuple[float, list[tuple[int, float]], int]] = []
        # an n > 1 request runs as one sequence until its prompt is computed, then forks n - 1 siblings
        self.needs_fork = sampling_params.n > 1
        self.ngram = None  # NgramIndex of its tokens, once it speculates (prefixkv/spec_decode.py)
        # llguidance matcher of a structured-outputs request (prefixkv/structured_outputs.py): it
        # has consumed exactly this sequence's output tokens
        self.matcher = None
        # the chain hashes of its full blocks, as far as the KV cache needed them (kv/keys.py; an
        # int64 array, as token_ids)
        self.block_hashes = array("q")
        # the parent of its first block: its cache salt and partition, so it shares blocks only
        # with requests of the same two
        self.cache_root = cache_root(sampling_params.cache_salt, sampling_params.cache_partition)

    @property
    def can_speculate(self) -> bool:
        """Greedy with nothing that depends on per-position sampling state: a draft verified by
        argmax then yields exactly the tokens plain greedy decoding would (logprobs come from the
        verified positions' rows: bitwise those of plain decoding in batch-invariant mode)."""
        p = self.sampling_params
        return (p.greedy and p.n == 1 and not p.uses_penalties and p.structured_outputs is None
                and not p.bad_words and self.num_output_tokens >= p.min_tokens)

    @property
    def cache_tenant(self) -> tuple[str | None, str | None]:
        """(cache salt, cache partition): what its ``cache_root`` was made of (KV events tell the salt)."""
        p = self.sampling_params
        return p.cache_salt, p.cache_partition

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens].tolist()

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:].tolist()

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def fork(self, sample_index: int) -> "Request":
        """A sibling sequence at the same point (same tokens computed), for n > 1."""
        child = Request(self.request_id, (), self.sampling_params, self.arrival_order, self.seed, sample_index)
        child.token_ids = array("q", self.token_ids)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.status = self.status
        child.needs_fork = False
        child.matcher = None if self.matcher is None else self.matcher.deep_copy()
        child.block_hashes = array("q", self.block_hashes)
        return child

    def __repr__(self) -> str:
        return (f"Request({self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, prompt={self.num_prompt_tokens})")
