"""What the engine returns. No torch."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    """One generated token's log-probability, its rank and the top-k alternatives (raw model
    distribution): the engine's own record, and what ``CompletionOutput.token_logprobs`` lists."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]]  # [(token_id, logprob)], most likely first
    rank: int | None = None  # 1 + the number of tokens more likely than this one


@dataclass
class Logprob:
    """vLLM's shape: one entry of ``CompletionOutput.logprobs[i]`` (a dict token id -> Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request.

    Logprobs (when the request asked for them) come in two shapes: ``logprobs``, vLLM's
    ``list[dict[int, Logprob]]`` (per token: the generated token and the top-k, each with its
    logprob, rank and decoded text), and ``token_logprobs``, a ``TokenLogprob`` per token
    (token_id, logprob, top_logprobs as (id, logprob) pairs, rank). Migration: before this,
    ``logprobs`` held what ``token_logprobs`` holds now (``lp.logprob`` -> ``tl.logprob``,
    ``lp.top_logprobs`` -> ``tl.top_logprobs``)."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    token_logprobs: list[TokenLogprob] | None = None
    # Streaming: what is new since the last RequestOutput for this request. With the request's
    # output_kind "delta", token_ids / text / token_logprobs hold the same until the final output.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_token_logprobs: list[TokenLogprob] | None = None
    # token id -> its text, for ``Logprob.decoded_token`` (set by the engine; read only when
    # ``logprobs`` is)
    decode_token: Callable[[int], str] | None = field(default=None, repr=False, compare=False)

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        """vLLM's shape (see the class docstring), built on first read."""
        return None if self.token_logprobs is None else _vllm_logprobs(self.token_logprobs, self.decode_token)

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the generated tokens' logprobs (None without logprobs), as vLLM's."""
        return None if self.token_logprobs is None else float(sum(tl.logprob for tl in self.token_logprobs))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's result (``finished``) or progress. ``token_ids`` / ``text`` /
    ``finish_reason`` / ``logprobs`` mirror ``outputs[0]``."""

    request_id: str
    prompt: str | None
    # the prompt's ids as the engine holds them (an int64 array, which the garbage collector does
    # not walk); ``prompt_token_ids`` is the list, made on first read
    _prompt_ids: Sequence[int] = field(repr=False)
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # set when the engine failed this request (outputs is then empty): "ExceptionType: message"
    error: str | None = None
    # with SamplingParams.prompt_logprobs, once the prompt is computed: prompt token i + 1's
    # record at [i] (``prompt_logprobs`` is vLLM's shape of it)
    prompt_token_logprobs: list[TokenLogprob] | None = None
    decode_token: Callable[[int], str] | None = field(default=None, repr=False, compare=False)

    @property
    def prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        """vLLM's shape: None for the first prompt token, then a dict per token (the prompt token
        and the top-k, each with logprob, rank and decoded text)."""
        if self.prompt_token_logprobs is None:
            return None
        return [None] + _vllm_logprobs(self.prompt_token_logprobs, self.decode_token)

    @property
    def prompt_token_ids(self) -> list[int]:
        if not isinstance(self._prompt_ids, list):
            self._prompt_ids = list(self._prompt_ids)
        return self._prompt_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self._prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, Logprob]] | None:
        return self.outputs[0].logprobs

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


def _vllm_logprobs(records: list[TokenLogprob], decode: Callable[[int], str] | None) -> list[dict[int, Logprob]]:
    dec = decode or (lambda _t: None)
    out = []
    for tl in records:
        entry = {tid: Logprob(v, r, dec(tid)) for r, (tid, v) in enumerate(tl.top_logprobs, start=1)}
        entry[tl.token_id] = Logprob(tl.logprob, tl.rank, dec(tl.token_id))
        out.append(entry)
    return out


def _cat(a: list | None, b: list | None) -> list | None:
    return None if a is None and b is None else (a or []) + (b or [])


def merge_outputs(old: RequestOutput, new: RequestOutput, delta: bool) -> RequestOutput:
    """One output standing for ``old`` then ``new`` (a consumer that fell behind): the delta fields
    are concatenated; so are token_ids / text / logprobs when they are deltas (``delta`` and
    ``new`` not finished); otherwise ``new``'s cumulative or final values stand."""
    prev = {co.index: co for co in old.outputs}
    outs = []
    for co in new.outputs:
        p = prev.get(co.index)
        if p is not None:
            co = CompletionOutput(
                index=co.index, finish_reason=co.finish_reason, stop_reason=co.stop_reason,
                token_ids=p.token_ids + co.token_ids if delta and not new.finished else co.token_ids,
                text=p.text + co.text if delta and not new.finished else co.text,
                token_logprobs=(_cat(p.token_logprobs, co.token_logprobs) if delta and not new.finished
                                else co.token_logprobs),
                delta_text=p.delta_text + co.delta_text, delta_token_ids=p.delta_token_ids + co.delta_token_ids,
                delta_token_logprobs=_cat(p.delta_token_logprobs, co.delta_token_logprobs),
                decode_token=co.decode_token)
        outs.append(co)
    return RequestOutput(new.request_id, new.prompt, new._prompt_ids, outs, new.finished,
                         num_cached_tokens=new.num_cached_tokens,
                         prompt_token_logprobs=new.prompt_token_logprobs or old.prompt_token_logprobs,
                         decode_token=new.decode_token or old.decode_token)
