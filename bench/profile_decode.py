"""Where a prefixkv decode step goes, and what two attention changes would save.

    python -m bench.profile_decode [--batch 16] [--system-tokens 200] [--steps 20]

Builds the shared-prefix state (B requests sharing an S-token system prompt, prefilled), then times
decode steps with each part wrapped by a timer: scheduler, runner input building, sampling-batch
building, model forward, and inside it the attention backend. Then, on the same KV cache, it times
decode-attention variants for one layer's inputs (outputs compared to the padded one):

    engine      prefixkv's TorchAttentionBackend._decode (cascade over shared prefixes) + its plan
    padded      gather every sequence's blocks, permute+reshape (a second copy), batched matmuls
    one-copy    the padded maths on the gathered blocks as they come (no permute copy)
    cascade     this file's cascade: shared blocks read once, suffix per sequence, LSE merge

and times transformers' decode step (DynamicCache, SDPA) at the same batch and context.
Nothing in prefixkv is modified: the timers wrap instance attributes.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch


def _timed(store: dict, key: str, fn):
    def wrapper(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            store[key] += time.perf_counter() - t0
    return wrapper


def decode_engine(q, kv_layer, block_tables, seq_lens, scale):
    """prefixkv's own decode attention (cascade over shared prefixes), its per-step plan included."""
    from prefixkv.attention.torch_ref import TorchAttentionBackend, decode_plan

    plan = decode_plan(block_tables, seq_lens, kv_layer.shape[3])
    return TorchAttentionBackend._decode(q, kv_layer, plan, scale)


def decode_engine_dim0(q, kv_layer, block_tables, seq_lens, scale):
    """prefixkv's cascade decode with one change: K and V gathered separately along the block axis
    of the contiguous [num_blocks + 1, KVH, bs, D] halves (``kv[0][blocks]``), instead of
    ``kv[:, blocks]`` (an advanced index on axis 1 of the 5-D layer, a slow general gather)."""
    from prefixkv.attention import torch_ref as tr

    plan = tr.decode_plan(block_tables, seq_lens, kv_layer.shape[3])
    b, h, d = q.shape
    kvh, bs = kv_layer.shape[2], kv_layer.shape[3]
    g = h // kvh
    blocks, pad = plan.suffix_blocks, plan.suffix_pad
    nb = blocks.shape[1]
    k = kv_layer[0][blocks].permute(0, 2, 1, 3, 4).reshape(b, kvh, nb * bs, d)
    v = kv_layer[1][blocks].permute(0, 2, 1, 3, 4).reshape(b, kvh, nb * bs, d)
    scores = torch.matmul(q.view(b, kvh, g, d), k.transpose(-1, -2)) * scale
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    m = scores.amax(dim=-1)
    m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(scores - m_safe[..., None])
    l = p.sum(dim=-1)
    o = torch.matmul(p, v)
    for idx, pblocks in plan.prefix_groups:
        n = idx.shape[0]
        kp = kv_layer[0][pblocks].permute(1, 0, 2, 3).reshape(kvh, -1, d)
        vp = kv_layer[1][pblocks].permute(1, 0, 2, 3).reshape(kvh, -1, d)
        qk = q[idx].view(n, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, n * g, d)
        sc = torch.matmul(qk, kp.transpose(-1, -2)) * scale
        pm = sc.amax(dim=-1)
        pp = torch.exp(sc - pm[..., None])
        pl = pp.sum(dim=-1)
        po = torch.matmul(pp, vp).view(kvh, n, g, d).permute(1, 0, 2, 3)
        pm, pl = pm.view(kvh, n, g).permute(1, 0, 2), pl.view(kvh, n, g).permute(1, 0, 2)
        mm = torch.maximum(m[idx], pm)
        a, pa = torch.exp(m[idx] - mm), torch.exp(pm - mm)
        o[idx] = o[idx] * a[..., None] + po * pa[..., None]
        l[idx] = l[idx] * a + pl * pa
    return (o / l[..., None]).view(b, h, d)


def decode_padded(q, kv_layer, block_tables, seq_lens, scale):
    """No sharing: gather every sequence's blocks, permute+reshape (a second copy), batched matmuls
    (prefixkv's decode before cascade attention)."""
    b, h, d = q.shape
    kvh, bs = kv_layer.shape[2], kv_layer.shape[3]
    nb = -(-max(seq_lens) // bs)
    kv = kv_layer[:, block_tables[:, :nb].long()]  # [2, B, nb, KVH, bs, D]
    kv = kv.permute(0, 1, 3, 2, 4, 5).reshape(2, b, kvh, nb * bs, d)
    keys, values = kv[0], kv[1]
    g = h // kvh
    scores = torch.matmul(q.view(b, kvh, g, d), keys.transpose(-1, -2)) * scale
    lens = torch.tensor(seq_lens)
    pad = torch.arange(nb * bs)[None, :] >= lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).view(b, h, d)


def decode_one_copy(q, kv_layer, block_tables, seq_lens, scale):
    """The same maths on the gathered [B, nb, KVH, bs, D] blocks as they come (one copy each of K
    and V, no permute copy): batched matmuls per (sequence, block, kv head); only the small score
    tensor is permuted for the softmax over (block, offset)."""
    b, h, d = q.shape
    kvh, bs = kv_layer.shape[2], kv_layer.shape[3]
    nb = -(-max(seq_lens) // bs)
    bt = block_tables[:, :nb].long()
    keys, vals = kv_layer[0][bt], kv_layer[1][bt]  # [B, nb, KVH, bs, D]
    g = h // kvh
    qg = q.view(b, 1, kvh, g, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2))  # [B, nb, KVH, G, bs]
    scores = scores.permute(0, 2, 3, 1, 4).reshape(b, kvh, g, nb * bs) * scale  # small
    lens = torch.tensor(seq_lens)
    pad = torch.arange(nb * bs)[None, :] >= lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(b, kvh, g, nb, bs).permute(0, 3, 1, 2, 4)  # [B, nb, KVH, G, bs]
    out = torch.matmul(probs, vals).sum(1)  # [B, KVH, G, D]
    return out.reshape(b, h, d)


def decode_cascade(q, kv_layer, block_tables, seq_lens, scale, num_shared_blocks: int):
    """Shared leading blocks read once for the whole batch, suffix per sequence, LSE merge."""
    b, h, d = q.shape
    kvh, bs = kv_layer.shape[2], kv_layer.shape[3]
    g = h // kvh
    shared = block_tables[0, :num_shared_blocks].long()
    ks = kv_layer[0, shared].permute(1, 0, 2, 3).reshape(kvh, -1, d)  # [KVH, Ls, D]
    vs = kv_layer[1, shared].permute(1, 0, 2, 3).reshape(kvh, -1, d)
    qh = q.view(b, kvh, g, d).permute(1, 0, 2, 3).reshape(kvh, b * g, d)  # [KVH, B*G, D]
    s1 = torch.matmul(qh, ks.transpose(-1, -2)) * scale  # [KVH, B*G, Ls]
    m1 = s1.amax(-1, keepdim=True)
    p1 = torch.exp(s1 - m1)
    l1 = p1.sum(-1, keepdim=True)
    o1 = torch.matmul(p1, vs)  # [KVH, B*G, D]
    # suffix blocks, per sequence
    ls = num_shared_blocks * bs
    nb = -(-max(seq_lens) // bs) - num_shared_blocks
    bt = block_tables[:, num_shared_blocks:num_shared_blocks + nb].long()
    k2 = kv_layer[0][bt].permute(0, 2, 1, 3, 4).reshape(b, kvh, nb * bs, d)
    v2 = kv_layer[1][bt].permute(0, 2, 1, 3, 4).reshape(b, kvh, nb * bs, d)
    qg = q.view(b, kvh, g, d)
    s2 = torch.matmul(qg, k2.transpose(-1, -2)) * scale  # [B, KVH, G, L2]
    lens = torch.tensor(seq_lens) - ls
    pad = torch.arange(nb * bs)[None, :] >= lens[:, None]
    s2.masked_fill_(pad[:, None, None, :], float("-inf"))
    m2 = s2.amax(-1, keepdim=True)
    p2 = torch.exp(s2 - m2)
    l2 = p2.sum(-1, keepdim=True)
    o2 = torch.matmul(p2, v2)  # [B, KVH, G, D]
    # merge: bring the shared part to [B, KVH, G, *]
    o1 = o1.view(kvh, b, g, d).permute(1, 0, 2, 3)
    m1 = m1.view(kvh, b, g, 1).permute(1, 0, 2, 3)
    l1 = l1.view(kvh, b, g, 1).permute(1, 0, 2, 3)
    m = torch.maximum(m1, m2)
    a1, a2 = torch.exp(m1 - m), torch.exp(m2 - m)
    out = (o1 * a1 + o2 * a2) / (l1 * a1 + l2 * a2)
    return out.reshape(b, h, d)


def _time(fn, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_decode")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None)
    p.add_argument("--no-hf", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from bench.cli_impl import build_workload, load_tokenizer
    from prefixkv import LLM, SamplingParams
    from prefixkv.runner import model_runner as mr

    path, tok = load_tokenizer(args.model)
    ns = argparse.Namespace(groups=1, per_group=args.batch, system_tokens=args.system_tokens,
                            question_tokens=args.question_tokens, output_tokens=1, seed=0)
    w = build_workload("shared-prefix", ns, tok)
    llm = LLM(model=args.model, dtype="float32", num_kv_blocks=4096, max_num_seqs=max(64, args.batch))
    eng = llm.engine
    sp = SamplingParams(max_tokens=args.steps + 20, temperature=0.0, ignore_eos=True)
    for i, r in enumerate(w.rounds[0]):
        eng.add_request(f"p{i}", r.prompt, sp)
    while eng.scheduler.num_waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running):
        eng.step()
    for _ in range(3):
        eng.step()

    t = defaultdict(float)
    runner, sched = eng.runner, eng.scheduler
    backend = runner.backend
    sched.schedule = _timed(t, "scheduler.schedule", sched.schedule)
    sched.update = _timed(t, "scheduler.update", sched.update)
    runner.prepare = _timed(t, "runner.prepare", runner.prepare)
    runner.sampling_batch = _timed(t, "runner.sampling_batch", runner.sampling_batch)
    runner.model.forward = _timed(t, "model.forward", runner.model.forward)
    backend.forward = _timed(t, "attention (backend.forward, 30 layers)", backend.forward)
    mr.sample = _timed(t, "sampler.sample", mr.sample)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    total = time.perf_counter() - t0
    ctx = max(r.num_tokens for r in sched.running)
    rows = {k: round(v / args.steps * 1e3, 2) for k, v in t.items()}
    rows["whole step"] = round(total / args.steps * 1e3, 2)
    print(f"decode step, batch {args.batch}, context ~{ctx} tokens ({args.system_tokens} shared), ms per step:")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<42} {v:8.2f}")

    # attention variants on the live KV cache (layer 0 inputs shapes)
    reqs = list(sched.running)
    tables = [eng.scheduler.kv.block_tables[r.seq_id][0] for r in reqs]
    nbmax = max(len(x) for x in tables)
    bt = torch.zeros((len(tables), nbmax), dtype=torch.int32)
    for i, x in enumerate(tables):
        bt[i, :len(x)] = torch.tensor(x, dtype=torch.int32)
    seq_lens = [r.num_computed_tokens for r in reqs]
    shared = 0
    while shared < min(len(x) for x in tables) and len({x[shared] for x in tables}) == 1 \
            and (shared + 1) * eng.config.cache.block_size <= min(seq_lens):
        shared += 1
    s = eng.runner.model.shape
    q = torch.randn(len(reqs), s.num_heads, s.head_dim)
    layer = runner.kv_cache[0]
    scale = s.head_dim ** -0.5
    ref = decode_padded(q, layer, bt, seq_lens, scale)
    reps = 20
    variants = {
        "engine (cascade, plan included)": lambda: decode_engine(q, layer, bt, seq_lens, scale),
        "engine, dim-0 K/V gathers": lambda: decode_engine_dim0(q, layer, bt, seq_lens, scale),
        "padded gather, no sharing": lambda: decode_padded(q, layer, bt, seq_lens, scale),
        "padded, one copy": lambda: decode_one_copy(q, layer, bt, seq_lens, scale),
        "cascade (this file)": lambda: decode_cascade(q, layer, bt, seq_lens, scale, shared),
    }
    att = {}
    for name, fn in variants.items():
        err = (fn() - ref).abs().max().item()
        att[name] = dict(ms_per_layer=round(_time(fn, reps) * 1e3, 3), max_abs_diff=err)
        print(f"  attention {name:<32} {att[name]['ms_per_layer']:7.3f} ms/layer "
              f"(x{s.num_layers} layers = {att[name]['ms_per_layer'] * s.num_layers:7.1f} ms), "
              f"max |diff| vs padded {err:.2e}")
    print(f"  ({shared} shared blocks of {eng.config.cache.block_size} tokens)")

    hf_ms = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        ids = torch.tensor([r.prompt for r in w.rounds[0]])
        with torch.inference_mode():
            o = m(ids, use_cache=True)
            past = o.past_key_values
            nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            n = ids.shape[1]
            for i in range(3):
                o = m(nxt, past_key_values=past, use_cache=True, position_ids=torch.full((len(ids), 1), n + i))
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            t0 = time.perf_counter()
            k = 10
            for i in range(k):
                o = m(nxt, past_key_values=past, use_cache=True, position_ids=torch.full((len(ids), 1), n + 3 + i))
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
            hf_ms = round((time.perf_counter() - t0) / k * 1e3, 2)
        print(f"transformers decode step (DynamicCache, SDPA), same batch and context: {hf_ms} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), context_tokens=ctx, shared_blocks=shared, step_ms=rows,
                           attention_variants=att, hf_decode_step_ms=hf_ms), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
