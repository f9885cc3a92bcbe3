"""Workloads as plain token ids with exact lengths.

A workload is a number of *rounds*; each round is a list of requests submitted together, and a
round may depend on what the system answered in the previous one (multi-turn resends the history
with the answer it got). Every system in a run sees the same requests, built from its own answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from bench.corpus import TokenStream

# ChatML role markers (SmolLM2's template; the tiny test tokenizer knows them too). With other
# tokenizers they are just text; lengths stay exact because they are counted after encoding.
SYSTEM_HEAD = "<|im_start|>system\n"
USER_HEAD = "<|im_start|>user\n"
END = "<|im_end|>\n"
ASSISTANT_HEAD = "<|im_start|>assistant\n"


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    n: int = 1
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class Workload:
    name: str
    params: dict
    rounds: list[list[BenchRequest]] = field(default_factory=list)  # fixed rounds
    # multi-turn: build round t from round t-1's requests and the system's own answers
    num_rounds: int = 1
    extend: object = None  # callable(t, prev_requests, prev_outputs) -> list[BenchRequest]
    greedy: bool = True

    def round(self, t: int, prev: list[BenchRequest] | None, prev_out: list[list[list[int]]] | None):
        if t < len(self.rounds):
            return self.rounds[t]
        return self.extend(t, prev, prev_out)

    @property
    def total_rounds(self) -> int:
        return max(self.num_rounds, len(self.rounds))


class PromptBuilder:
    def __init__(self, tokenizer, stream: TokenStream) -> None:
        self.tok = tokenizer
        self.stream = stream
        self._enc: dict[str, list[int]] = {}

    def enc(self, text: str) -> list[int]:
        if text not in self._enc:
            self._enc[text] = self.tok.encode(text, add_special_tokens=False)
        return self._enc[text]

    def block(self, n: int, head: str = "", tail: str = "") -> list[int]:
        """Exactly ``n`` tokens: ``head`` + corpus text + ``tail`` (markers cut if n is tiny)."""
        h, t = self.enc(head), self.enc(tail)
        body = max(0, n - len(h) - len(t))
        ids = (h + self.stream.take(body) + t)[:n]
        if len(ids) < n:  # n smaller than the markers alone: pad with text
            ids += self.stream.take(n - len(ids))
        assert len(ids) == n, (len(ids), n)
        return ids


def shared_prefix(pb: PromptBuilder, groups: int, per_group: int, system_tokens: int, question_tokens: int,
                  output_tokens: int, seed: int = 0) -> Workload:
    """G groups x P requests; a group's requests share an S-token system prompt, each has its own
    Q-token question. Submission order is shuffled (arrivals interleave groups)."""
    reqs = []
    for _ in range(groups):
        system = pb.block(system_tokens, SYSTEM_HEAD, END)
        for _ in range(per_group):
            q = pb.block(question_tokens, USER_HEAD, END + ASSISTANT_HEAD)
            reqs.append(BenchRequest(system + q, output_tokens))
    random.Random(seed).shuffle(reqs)
    params = dict(groups=groups, per_group=per_group, system_tokens=system_tokens,
                  question_tokens=question_tokens, output_tokens=output_tokens, seed=seed)
    return Workload("shared-prefix", params, rounds=[reqs])


def multi_turn(pb: PromptBuilder, conversations: int, turns: int, system_tokens: int, user_tokens: int,
               output_tokens: int, shared_system: bool = False) -> Workload:
    """C conversations x T turns. Turn t resends the whole history (including the answer the system
    generated at turn t-1) plus a new U-token user message; turns are sequential within a
    conversation, conversations run together (turn t of all of them is one round)."""
    shared = pb.block(system_tokens, SYSTEM_HEAD, END) if shared_system else None
    systems = [shared or pb.block(system_tokens, SYSTEM_HEAD, END) for _ in range(conversations)]
    # user messages are fixed up front so every system gets the same ones
    users = [[pb.block(user_tokens, USER_HEAD, END + ASSISTANT_HEAD) for _ in range(conversations)]
             for _ in range(turns)]
    end = pb.enc(END)
    first = [BenchRequest(systems[c] + users[0][c], output_tokens) for c in range(conversations)]

    def extend(t, prev, prev_out):
        return [BenchRequest(p.prompt + out[0] + end + users[t][c], output_tokens)
                for c, (p, out) in enumerate(zip(prev, prev_out))]

    params = dict(conversations=conversations, turns=turns, system_tokens=system_tokens, user_tokens=user_tokens,
                  output_tokens=output_tokens, shared_system=shared_system,
                  final_context_tokens=system_tokens + turns * user_tokens + (turns - 1) * (output_tokens + len(end)))
    return Workload("multi-turn", params, rounds=[first], num_rounds=turns, extend=extend)


def cold(pb: PromptBuilder, num_requests: int, min_tokens: int, max_tokens: int, output_tokens: int,
         seed: int = 0) -> Workload:
    """Prompts of mixed lengths (uniform in [min, max]) from disjoint text windows: no sharing."""
    rng = random.Random(seed)
    reqs = [BenchRequest(pb.block(rng.randint(min_tokens, max_tokens)), output_tokens) for _ in range(num_requests)]
    params = dict(num_requests=num_requests, min_tokens=min_tokens, max_tokens=max_tokens,
                  output_tokens=output_tokens, seed=seed,
                  prompt_tokens=[len(r.prompt) for r in reqs])
    return Workload("cold", params, rounds=[reqs])


def parallel_sampling(pb: PromptBuilder, num_requests: int, prompt_tokens: int, output_tokens: int, n: int = 4,
                      temperature: float = 1.0, seed: int = 0) -> Workload:
    """Each prompt sampled n times (temperature 1, seeded): the n samples share the prompt."""
    reqs = [BenchRequest(pb.block(prompt_tokens, USER_HEAD, END + ASSISTANT_HEAD), output_tokens, n=n,
                         temperature=temperature, seed=seed + i) for i in range(num_requests)]
    params = dict(num_requests=num_requests, prompt_tokens=prompt_tokens, output_tokens=output_tokens, n=n,
                  temperature=temperature, seed=seed)
    return Workload("parallel-sampling", params, rounds=[reqs], greedy=False)
