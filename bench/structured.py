"""What structured outputs cost (issue 18), on the embedded SmolLM2 in float32:

1. throughput at batch 16: 16 chat requests constrained to JSON schemas against the same 16
   requests unconstrained, each generating exactly as many tokens as its constrained twin did
   (``ignore_eos``, ``max_tokens`` = that count), 3 repeats taking turns, medians;
2. the per-step mask time at 64 constrained rows (``fill_bitmask`` over 64 matchers, each at a
   different point of a JSON document), median over the positions.

    python -m bench.structured [--repeat 3] [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def _schemas() -> list[dict]:
    colors = {"type": "string", "enum": ["red", "green", "blue"]}
    out = []
    for i in range(16):
        props = {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 1, "maximum": 99}}
        if i % 2:
            props["favorite_color"] = colors
        if i % 3 == 0:
            props["address"] = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                                "required": ["city"], "additionalProperties": False}
        if i % 4 == 1:
            props["scores"] = {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10},
                               "maxItems": 3}
        out.append({"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    from prefixkv import LLM, SamplingParams
    from prefixkv.structured_outputs import StructuredOutputsParams, fill_bitmask

    llm = LLM(model=None, dtype="float32")
    people = ["a baker", "a pilot", "a child", "a teacher"]
    convs = [[{"role": "user", "content": f"Describe {people[i % 4]} as JSON."}] for i in range(16)]
    constrained = [SamplingParams(max_tokens=300, temperature=0.0, structured_outputs={"json": s}) for s in _schemas()]
    first = llm.chat(convs, constrained, use_tqdm=False)  # warm-up, and the per-request lengths to match
    lengths = [len(o.outputs[0].token_ids) for o in first]
    free = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    times: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    for r in range(a.repeat):
        order = [("constrained", constrained), ("unconstrained", free)]
        for name, params in (order if r % 2 == 0 else order[::-1]):
            llm.engine.scheduler.kv.reset_cache()  # every repeat prefills the same way
            t0 = time.perf_counter()
            outs = llm.chat(convs, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
            assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    total = sum(lengths)
    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["constrained"] / med["unconstrained"] - 1

    # the mask at 64 rows: matchers fed growing prefixes of the 16 documents (4 positions each)
    grammars = llm.engine.grammars
    matchers = []
    for o, s in zip(first, _schemas()):
        ids = o.outputs[0].token_ids
        for frac in (0.0, 0.25, 0.5, 0.75):
            m = grammars.matcher(StructuredOutputsParams(json=s))
            assert m.consume_tokens(ids[:int(len(ids) * frac)])
            matchers.append(m)
    vocab = llm.engine.info.vocab_size
    fill_bitmask(matchers, vocab)
    mask_ms = []
    for _ in range(20):
        t0 = time.perf_counter()
        fill_bitmask(matchers, vocab)
        mask_ms.append((time.perf_counter() - t0) * 1e3)
    import sys

    args = sys.argv[1:] if argv is None else argv
    doc = dict(command=" ".join(["python -m bench.structured", *args]), output_tokens=total, lengths=lengths,
               seconds=times, median_s=med, constrained_overhead=round(overhead, 4),
               out_tok_s={k: round(total / v, 1) for k, v in med.items()},
               mask_64_rows_ms_median=round(statistics.median(mask_ms), 3), mask_64_rows_ms_min=round(min(mask_ms), 3))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: doc[k] for k in ("out_tok_s", "constrained_overhead", "mask_64_rows_ms_median")}))
    print(f"wrote {out / 'structured.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
