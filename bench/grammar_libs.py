"""llguidance (the engine's grammar library) against xgrammar (vLLM's and SGLang's default) on our
shapes (issue 18): SmolLM2's tokenizer (49,152 tokens), the 16 JSON schemas of ``bench.structured``.

For each schema: the time to compile it, then the time to fill one row's token mask at every
position of a real reply (the tokens SmolLM2 wrote under that schema, greedy, through prefixkv),
each library fed the same tokens. Single-threaded, one row at a time (what the engine does per
constrained row). xgrammar is not a dependency: ``tools/peer-xgrammar`` installs it (and its one
needed runtime package, apache-tvm-ffi, without triton) into ``.peers/xgrammar``, and this
benchmark imports it from there.

    tools/peer-xgrammar && python -m bench.grammar_libs [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / ".peers" / "xgrammar"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    a = p.parse_args(argv)
    sys.path.insert(0, str(PEER))
    import llguidance
    import llguidance.hf
    import numpy as np
    import torch
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from bench.structured import _schemas
    from prefixkv import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM(model=None, dtype="float32")
    hf_tok = AutoTokenizer.from_pretrained(str(llm.engine.model_path))
    v = llm.engine.info.vocab_size
    eos = llm.engine.info.eos_token_ids
    people = ["a baker", "a pilot", "a child", "a teacher"]
    schemas = _schemas()
    convs = [[{"role": "user", "content": f"Describe {people[i % 4]} as JSON."}] for i in range(len(schemas))]
    replies = [o.outputs[0].token_ids for o in llm.chat(
        convs, [SamplingParams(max_tokens=300, temperature=0.0, structured_outputs={"json": s}) for s in schemas])]

    ll_tok = llguidance.hf.from_tokenizer(hf_tok, n_vocab=v, eos_token=eos)
    xg_info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=v, stop_token_ids=eos)
    xg_compiler = xgr.GrammarCompiler(xg_info, max_threads=1, cache_enabled=False)
    rows = []
    for schema, toks in zip(schemas, replies):
        text = json.dumps(schema)
        t0 = time.perf_counter()
        grammar = llguidance.grammar_from("json_schema", text)
        m = llguidance.LLMatcher(ll_tok, grammar)
        ll_compile = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = xg_compiler.compile_json_schema(text, any_whitespace=True, strict_mode=True)
        xm = xgr.GrammarMatcher(compiled)
        xg_compile = time.perf_counter() - t0
        bits = np.zeros((v + 31) // 32, dtype=np.int32)
        xbits = xgr.allocate_token_bitmask(1, v)
        ll_t, xg_t, agree = [], [], 0
        for t in toks:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
            ll_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            xm.fill_next_token_bitmask(xbits)
            xg_t.append(time.perf_counter() - t0)
            allowed_ll = (int(bits[t // 32]) >> (t % 32)) & 1
            allowed_xg = (int(xbits[0, t // 32]) >> (t % 32)) & 1
            agree += allowed_ll == allowed_xg == 1
            assert m.consume_token(t), (t, m.get_error())
            if t not in eos:
                assert xm.accept_token(t), t
        rows.append(dict(tokens=len(toks), llguidance_compile_ms=round(ll_compile * 1e3, 2),
                         xgrammar_compile_ms=round(xg_compile * 1e3, 2),
                         llguidance_mask_us_median=round(statistics.median(ll_t) * 1e6, 1),
                         xgrammar_mask_us_median=round(statistics.median(xg_t) * 1e6, 1),
                         llguidance_mask_us_max=round(max(ll_t) * 1e6, 1),
                         xgrammar_mask_us_max=round(max(xg_t) * 1e6, 1),
                         both_allow_the_written_token=f"{agree}/{len(toks)}"))
        print(json.dumps(rows[-1]), flush=True)
    summary = {k: round(statistics.median(r[k] for r in rows), 2) for k in rows[0] if k.endswith(("_ms", "_median"))}
    print("medians over the schemas:", json.dumps(summary))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"grammar-libs-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(dict(workload="grammar-libs", command="python -m bench.grammar_libs",
                                    xgrammar=getattr(xgr, "__version__", "0.2.8"),
                                    llguidance=llguidance.__version__, vocab_size=v, schemas=len(rows),
                                    rows=rows, summary=summary), indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
