"""N-gram ("prompt lookup") draft proposals for exact speculative decoding. No torch.

A decoding request whose last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``)
occurred earlier in its own prompt or output proposes the tokens that followed that earlier
occurrence (its most recent one) as a draft. The engine then computes the last sampled token and
the draft in one forward pass and keeps the draft's longest prefix that greedy decoding would have
produced token by token, plus the model's own next token (so every step yields at least one token):

    known tokens  ... a b c | x            draft (seen after "b c" earlier): y z w
    query         x y z w                  argmax at each position:          y z q r
    accepted      y z   + bonus q          (w != q: w and later are discarded)

Only greedy requests (no penalties, n = 1) speculate, so the output equals plain greedy decoding;
what changes is how many tokens one pass over the weights yields. A kept token's logprobs are its
verified row's: bitwise those of plain decoding in batch-invariant mode, float-close otherwise.

The index is incremental: each request keeps a dict from n-gram to the end of its latest
occurrence, extended with the tokens appended since the previous proposal (O(new tokens) per step).
"""

from __future__ import annotations

from typing import Sequence


# Only n-grams within this many tokens of the end are looked up: the first proposal of a long
# prompt indexes at most this window (~3 dict entries per token), not the whole prompt.
MAX_WINDOW = 4096


class NgramIndex:
    __slots__ = ("nmin", "nmax", "ends", "upto")

    def __init__(self, nmin: int, nmax: int) -> None:
        self.nmin, self.nmax = nmin, nmax
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.upto = 0  # n-grams ending before this position are indexed

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (empty if no n-gram recurs)."""
        if k <= 0:
            return []
        n_tok = len(tokens)
        ends = self.ends
        # index every n-gram ending at e < n_tok (never the suffix itself: it would match itself)
        for e in range(max(self.upto, 1, n_tok - MAX_WINDOW), n_tok):
            for n in range(self.nmin, min(self.nmax, e) + 1):
                ends[tuple(tokens[e - n:e])] = e
        self.upto = max(self.upto, n_tok)
        for n in range(min(self.nmax, n_tok), self.nmin - 1, -1):
            e = ends.get(tuple(tokens[n_tok - n:]))
            if e is not None:
                return list(tokens[e:e + k])
        return []


def accept_greedy(draft: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """Tokens a draft yields: ``argmax[i]`` is the model's greedy choice after the known tokens and
    ``draft[:i]``; the longest matching prefix of the draft is kept, plus the model's next token."""
    j = 0
    while j < len(draft) and draft[j] == argmax[j]:
        j += 1
    return list(argmax[:j + 1])
