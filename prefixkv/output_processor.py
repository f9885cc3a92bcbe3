"""From sampled tokens to ``RequestOutput``s: incremental detokenization, stop conditions (eos,
stop token ids, stop strings, max_tokens, the context limit), stop-string hold-back and deltas.
The engine's own loop only schedules, runs and hands the new tokens here (vLLM v1's
``OutputProcessor`` has this job). No torch.

Per step and sequence the work is proportional to the new tokens, never to what came before:
text is kept as pieces (``TextBuffer``), stop strings are searched in the tail the new text can
complete, and outputs of kind ``delta`` / ``final_only`` carry only what is new (the final output
holds the full lists once). ``cumulative`` outputs (the default of ``LLMEngine.step``) copy the
whole text and token list every step, as their caller asked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixkv.outputs import CompletionOutput, RequestOutput, TokenLogprob
from prefixkv.request import Request, RequestStatus
from prefixkv.sampling_params import SamplingParams
from prefixkv.structured_outputs import StructuredOutputError
from prefixkv.tokenizer import IncrementalDetokenizer, Tokenizer


class TextBuffer:
    """A string built by appends without quadratic concatenation; reads near the end are cheap.

    ``num_chars_copied`` counts the characters joins have copied (complexity tests)."""

    __slots__ = ("_pieces", "length", "num_chars_copied")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self.length = 0
        self.num_chars_copied = 0

    def append(self, s: str) -> None:
        if s:
            self._pieces.append(s)
            self.length += len(s)

    def tail_from(self, start: int) -> str:
        """``text[start:]``, reading only the pieces it spans."""
        start = max(0, start)
        if self._pieces and start == self.length - len(self._pieces[-1]):  # the last piece (streaming)
            return self._pieces[-1]
        need, parts = self.length - start, []
        for p in reversed(self._pieces):
            if need <= 0:
                break
            parts.append(p)
            need -= len(p)
        s = "".join(reversed(parts))
        self.num_chars_copied += len(s)
        return s[len(s) - (self.length - start):] if self.length > start else ""

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` characters (a stop string cuts the text)."""
        if n >= self.length:
            return
        text = self.value()[:n]
        self._pieces, self.length = ([text] if text else []), n

    def value(self) -> str:
        if len(self._pieces) > 1:
            joined = "".join(self._pieces)
            self.num_chars_copied += len(joined)
            self._pieces = [joined]
        return self._pieces[0] if self._pieces else ""


@dataclass
class SeqOutputState:
    """Output-side state of one sequence: detokenized text, what was sent, why it finished."""

    detok: IncrementalDetokenizer
    text: TextBuffer = field(default_factory=TextBuffer)
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    num_sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_processed: int = 0  # output tokens already detokenized and checked for stops
    finish_sent: bool = False  # an output with finish_reason went out


@dataclass
class RequestState:
    """One request as the engine and the output processor see it: the parent of its n sequences
    (samples 0 .. n-1; kept in ``seqs``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: Sequence[int]  # an int64 array (not walked by the garbage collector)
    params: SamplingParams
    seqs: dict[int, Request] = field(default_factory=dict)  # sample_index -> sequence
    states: dict[int, SeqOutputState] = field(default_factory=dict)
    num_finished: int = 0  # samples with a finish_reason (set by OutputProcessor.finish only)
    # with SamplingParams.prompt_logprobs: prompt token i + 1's record at [i], as computed
    prompt_logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.num_finished == self.params.n


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, eos_token_ids: list[int], max_model_len: int,
                 stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.stream_interval = stream_interval  # the least of every request's (SchedulerConfig.stream_interval)

    def due(self, parent: RequestState) -> bool:
        """Whether a running request's output goes out now under its stream interval: a sample's
        first token, every ``interval`` new tokens of a sample, a sample's finish."""
        interval = max(self.stream_interval, parent.params.stream_interval or 1)
        if interval == 1 or parent.finished:
            return True
        seqs = parent.seqs
        for idx, st in parent.states.items():
            if (st.num_sent_tokens == 0 or seqs[idx].num_output_tokens - st.num_sent_tokens >= interval
                    or (st.finish_reason is not None and not st.finish_sent)):
                return True
        return False

    def decode_token(self, token_id: int) -> str:
        """One token's text alone (vLLM's ``Logprob.decoded_token``)."""
        return self.tokenizer.token_text(token_id, skip_special_tokens=False)

    def state(self, parent: RequestState, seq: Request) -> SeqOutputState:
        st = parent.states.get(seq.sample_index)
        if st is None:
            st = SeqOutputState(IncrementalDetokenizer(self.tokenizer, parent.prompt_token_ids,
                                                       skip_special_tokens=parent.params.skip_special_tokens))
            parent.states[seq.sample_index] = st
        return st

    def process_tokens(self, parent: RequestState, seq: Request) -> tuple[RequestStatus, int | str | None] | None:
        """Detokenize a sequence's new tokens (several after an accepted speculative draft) and apply
        the stop conditions to each in turn; tokens after the one that finishes it are dropped from
        ``seq.token_ids``. Returns (status, stop reason) if it finished; the caller then calls
        ``finish`` and frees the sequence."""
        st = self.state(parent, seq)
        finish = None
        while st.num_processed < seq.num_output_tokens:
            st.num_processed += 1
            finish = self._process_token(parent, seq, st, seq.num_prompt_tokens + st.num_processed - 1)
            if finish is not None:
                del seq.token_ids[seq.num_prompt_tokens + st.num_processed:]
                del seq.logprobs[st.num_processed:]  # (a stop inside an accepted draft)
                break
        if seq.logprobs and len(st.logprobs) < len(seq.logprobs):
            for chosen, top, rank in seq.logprobs[len(st.logprobs):]:
                st.logprobs.append(TokenLogprob(seq.token_ids[seq.num_prompt_tokens + len(st.logprobs)], chosen, top,
                                                rank))
        return finish

    def _process_token(self, parent: RequestState, seq: Request, st: SeqOutputState,
                       i: int) -> tuple[RequestStatus, int | str | None] | None:
        """Token ``i`` of ``seq``: detokenize it and check the stop conditions."""
        p = parent.params
        tok = seq.token_ids[i]
        n_out = i + 1 - seq.num_prompt_tokens
        if seq.matcher is not None and not seq.matcher.consume_token(tok):
            raise StructuredOutputError(f"structured_outputs: the grammar refused token {tok} "
                                        f"({seq.matcher.get_error()})")
        if not p.ignore_eos and tok in self.eos_token_ids and n_out > p.min_tokens - 1:
            return RequestStatus.FINISHED_STOPPED, None
        if tok in p.stop_token_ids and n_out > p.min_tokens - 1:
            return RequestStatus.FINISHED_STOPPED, tok
        if p.detokenize:
            prev = st.text.length
            st.text.append(st.detok.add(tok))
            if p.stop and n_out >= p.min_tokens and st.text.length > prev:
                hit = find_stop(st.text, p.stop, prev)
                if hit is not None:
                    idx, stop = hit
                    st.text.truncate(idx + len(stop) if p.include_stop_str_in_output else idx)
                    return RequestStatus.FINISHED_STOPPED, stop
        if seq.matcher is not None and seq.matcher.is_stopped():  # the grammar is complete
            return RequestStatus.FINISHED_STOPPED, None
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if i + 1 >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None

    def finish(self, parent: RequestState, seq: Request, status: RequestStatus, reason: int | str | None) -> None:
        st = self.state(parent, seq)
        if st.finish_reason is not None:
            return
        if parent.params.detokenize and not isinstance(reason, str):
            st.text.append(st.detok.flush())  # a stop string already cut the text
        st.finish_reason, st.stop_reason = status.value, reason
        parent.num_finished += 1

    def make_output(self, parent: RequestState) -> RequestOutput:
        p = parent.params
        cumulative = p.output_kind == "cumulative"
        stops = p.stop
        states = parent.states
        outs = []
        for idx in (states if len(states) == 1 else sorted(states)):
            st = states[idx]
            seq = parent.seqs[idx]
            finished = st.finish_reason is not None
            st.finish_sent = finished
            text = st.text
            sendable = text.length
            if sendable == st.num_sent_chars:  # no new text (or detokenize=False)
                delta = ""
            else:
                if not finished and stops:
                    sendable -= holdback(text.tail_from(text.length - max(map(len, stops)) + 1), stops)
                sendable = max(sendable, st.num_sent_chars)
                delta = text.tail_from(st.num_sent_chars)[:sendable - st.num_sent_chars]
                st.num_sent_chars = sendable
            start = seq.num_prompt_tokens + st.num_sent_tokens
            delta_ids = seq.token_ids[start:].tolist()
            st.num_sent_tokens += len(delta_ids)
            lps = delta_lps = None
            if p.logprobs is not None:
                lps = st.logprobs
                delta_lps = lps[st.num_sent_logprobs:]
                st.num_sent_logprobs = len(lps)
            if cumulative or finished:
                ids = seq.output_token_ids  # a fresh slice
                full = text.value()
                out_text = full if finished else full[:sendable]
                out_lps = None if lps is None else list(lps)
            else:  # delta: only what is new
                ids, out_text, out_lps = delta_ids, delta, delta_lps
            outs.append(CompletionOutput(idx, ids, out_text, st.finish_reason, st.stop_reason, out_lps, delta,
                                         delta_ids, delta_lps, None if lps is None else self.decode_token))
        plps = parent.prompt_logprobs
        if plps is not None and len(plps) < len(parent.prompt_token_ids) - 1:
            plps = None  # until the whole prompt is computed
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             parent.num_finished == p.n, parent.seqs[0].num_cached_tokens, None, plps,
                             None if plps is None else self.decode_token)

    @staticmethod
    def record_prompt_logprobs(parent: RequestState, entries: list[tuple[int, float, int, list]]) -> None:
        """A step's prompt logprobs for ``parent``, (position, logprob, rank, top) each; positions
        already recorded (a preempted request computes its prompt again) are skipped."""
        for pos, lp, rank, top in entries:
            if pos == len(parent.prompt_logprobs) + 1:
                parent.prompt_logprobs.append(TokenLogprob(parent.prompt_token_ids[pos], lp, top, rank))


def find_stop(text: TextBuffer, stops: list[str], prev_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the text added after ``prev_len`` (only the tail that new
    text can complete is read)."""
    start = max(0, prev_len - max(map(len, stops)) + 1)
    window = text.tail_from(start)
    best = None
    for s in stops:
        i = window.find(s, max(0, prev_len - len(s) + 1 - start))
        if i >= 0 and (best is None or start + i < best[0]):
            best = (start + i, s)
    return best


def holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that could begin a stop string."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n
