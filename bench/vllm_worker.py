"""vLLM (CPU build) as a benchmark peer, in its own interpreter: the virtualenv that
``tools/peer-vllm-cpu`` makes. Standard library + vllm only (this file is not imported by prefixkv).

Protocol: one JSON object per line on stdin, one answer per line on stdout (vLLM's own logging
goes to stderr)::

    {"op": "init", "model": DIR, "block_size": 16, ...}  -> {"ok": true, "setup_s": ..., "version": ...}
    {"op": "reset"}                                       -> {"ok": true}   (prefix cache dropped)
    {"op": "round", "requests": [{"prompt": [ids], "max_tokens": 32, "n": 1,
                                  "temperature": 0.0, "seed": null}, ...]}
        -> {"ok": true, "elapsed_s": ..., "outputs": [[[ids] per sample] per request],
            "num_cached_tokens": [...]}
    {"op": "exit"}

Errors answer {"ok": false, "error": "..."}; the parent raises them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> int:
    # the protocol gets a private copy of fd 1; fd 1 itself becomes stderr, so whatever vLLM and
    # its engine-core process print stays off the protocol channel
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    llm = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            op = msg["op"]
            if op == "exit":
                break
            if op == "init":
                t0 = time.perf_counter()
                from vllm import LLM, SamplingParams, __version__

                llm = LLM(model=msg["model"], dtype=msg.get("dtype", "float32"), block_size=msg["block_size"],
                          enable_prefix_caching=msg.get("enable_prefix_caching", True),
                          max_num_seqs=msg["max_num_seqs"], max_num_batched_tokens=msg["max_num_batched_tokens"],
                          max_model_len=msg["max_model_len"], seed=0, skip_tokenizer_init=True)
                setup_s = time.perf_counter() - t0
                # the first generate compiles / warms what start-up did not (excluded from timing)
                t1 = time.perf_counter()
                warm = [{"prompt_token_ids": [3 + (i * 7919 + k) % 1000 for i in range(40)]} for k in range(3)]
                llm.generate(warm, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
                llm.reset_prefix_cache()
                res = dict(ok=True, setup_s=round(setup_s, 2), warmup_s=round(time.perf_counter() - t1, 2),
                           version=__version__,
                           env={k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_"))})
            elif op == "reset":
                llm.reset_prefix_cache()
                res = dict(ok=True)
            elif op == "round":
                from vllm import SamplingParams

                reqs = msg["requests"]
                prompts = [{"prompt_token_ids": r["prompt"]} for r in reqs]
                params = [SamplingParams(max_tokens=r["max_tokens"], n=r.get("n", 1),
                                         temperature=r.get("temperature", 0.0), seed=r.get("seed"),
                                         ignore_eos=True, detokenize=False) for r in reqs]
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                res = dict(ok=True, elapsed_s=elapsed,
                           outputs=[[list(c.token_ids) for c in o.outputs] for o in outs],
                           num_cached_tokens=[o.num_cached_tokens or 0 for o in outs])
            else:
                res = dict(ok=False, error=f"unknown op {op!r}")
        except Exception as e:  # the parent records the error instead of a number
            res = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        proto.write(json.dumps(res) + "\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
