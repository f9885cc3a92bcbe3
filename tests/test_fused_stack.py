"""The decoder layers as one C call (prefixkv/model/fused_stack.py) against the Python loop over
the same kernels: token ids and logprobs bitwise equal (``==`` on the floats) on tiny random
float32 models with head_dim 64, in every kind of step the driver takes (decode steps; prefill
chunks in batch-invariant mode), and the driver is counted to have run. Where it cannot run
(blocks of 32 tokens, q/k norms, Gemma's layers), the Python loop serves the request."""

from __future__ import annotations

import shutil

import pytest

from prefixkv import LLM, SamplingParams, cpu_ops
from prefixkv.cpu_ops import gemm_available
from prefixkv.model import fused_stack
from test_lossless import random_prompts
from tiny_models import build_model, build_tokenizer

pytestmark = pytest.mark.skipif(not gemm_available(), reason="the driver needs an AVX-512 or AVX2 build")
_CALL = fused_stack.FusedStack.__call__


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """head_dim 64 (the C decode kernel's vector path): llama (untied head), qwen2 (q/k/v biases),
    mistral (tied embeddings), qwen3 (q/k norms and a sliding-window layer: not the driver's);
    llama-i96: intermediate size 96, a multiple of the GEMM's panel width (48 or 16), where prefill
    rows take SiLU·mul inside the gate/up GEMM."""
    tok = tmp_path_factory.mktemp("tok")
    vocab = build_tokenizer(tok)
    out = {}
    variants = {"llama-i96": ("llama", {"intermediate_size": 96})}
    for name in ("llama", "qwen2", "mistral", "qwen3", "llama-i96"):
        arch, overrides = variants.get(name, (name, {}))
        path = tmp_path_factory.mktemp(f"fused-{name}")
        for f in tok.iterdir():
            shutil.copy(f, path / f.name)
        build_model(path, arch, vocab, head_dim=64, **overrides)
        out[name] = (path, vocab)
    return out


def _run(monkeypatch, model_dir, vocab, fused: bool, **kw):
    """(results; the fused calls: how many, how many with prefill rows, the most rows of one; the LLM)."""
    monkeypatch.setenv("PREFIXKV_FUSED_STACK", "1" if fused else "0")
    calls = {"n": 0, "multi": 0, "rows": 0}

    def counted(self, h, cos, sin, meta, tables, lens, order):
        calls["n"] += 1
        calls["multi"] += int(meta.num_decode_seqs < meta.num_seqs)
        calls["rows"] = max(calls["rows"], h.shape[0])
        return _CALL(self, h, cos, sin, meta, tables, lens, order)

    monkeypatch.setattr(fused_stack.FusedStack, "__call__", counted)
    kw.setdefault("num_kv_blocks", 256)
    llm = LLM(model=str(model_dir), dtype="float32", **kw)
    llm.engine.check_integrity_each_step = True
    prompts = random_prompts(vocab, 9, 1, shared_len=41, max_own=50)
    prompts[4] = prompts[4][:3] * 8  # repetitive: n-gram drafts when speculation is on
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts, params)
    outs += llm.generate(prompts[:3], params)  # again: whole blocks from the prefix cache
    res = [(tuple(o.outputs[0].token_ids), tuple(lp.logprob for lp in o.outputs[0].token_logprobs),
            tuple(tuple(lp.top_logprobs) for lp in o.outputs[0].token_logprobs), o.num_cached_tokens) for o in outs]
    return res, calls, llm


CASES = {
    "default": {},
    "chunk-7": {"max_num_batched_tokens": 7},
    "block-8": {"block_size": 8},
    "variant-mode": {"batch_invariant": False},  # prefill steps keep the loop, decode steps fuse
    "preemption": {"max_num_batched_tokens": 64, "num_kv_blocks": 14},
    "speculative": {"num_speculative_tokens": 3},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "llama-i96"])
def test_fused_stack_is_bitwise_the_python_loop(models, monkeypatch, arch, case):
    path, vocab = models[arch]
    want, none, _ = _run(monkeypatch, path, vocab, False, **CASES[case])
    got, calls, llm = _run(monkeypatch, path, vocab, True, **CASES[case])
    assert none["n"] == 0
    assert llm.engine.runner.model.fused_stack_blocker == ""
    assert got == want
    assert calls["n"] >= 10  # every decode step at least
    if case == "variant-mode":
        assert calls["multi"] == 0  # prefill chunks outside batch-invariant mode: the prefill kernel, in the loop
    else:
        assert calls["multi"] > 0
    if arch == "llama-i96" and case in ("default", "block-8", "speculative"):
        # decoder_layers_f32 fuses SiLU·mul into the gate/up GEMM where the panels pair up, past one
        # row group (32 rows on AVX-512, 24 on AVX2): these cases' prefill steps are past it
        assert 96 % cpu_ops.load().gemm_panel_width() == 0 and calls["rows"] > 32
    if case == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    if case == "speculative":
        assert llm.engine.stats()["spec_draft_tokens"] > 0  # verified in multi-token rows


def test_silu_in_the_gate_up_gemm_on_1_to_3_threads(models, monkeypatch):
    """The gate/up panel pairs split among 1, 2 or 3 threads (2 pairs of 48, or 6 of 16: a thread may
    have none): the same bits as the Python loop (pytest-xdist runs one thread a worker)."""
    import torch

    path, vocab = models["llama-i96"]
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            want, _, _ = _run(monkeypatch, path, vocab, False)
            got, calls, _ = _run(monkeypatch, path, vocab, True)
            assert calls["rows"] > 32 and got == want, n
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("delay_us", [300, 30_000])
def test_the_callers_thread_takes_the_shares_of_workers_that_start_late(models, monkeypatch, delay_us):
    """The layer stack and the LM head run on cpu_ops.c's team: the caller's thread takes every
    share no worker has claimed, and a worker that arrives after its call is over claims nothing.
    Workers held back 0.3 ms (they join calls midway) or 30 ms (the caller does every share, and
    each worker wakes into a call that is over or a later one), on 2 and 3 threads: the same
    bits as the Python loop. The model's prefill steps run SiLU·mul inside the gate/up GEMM and its
    decode steps do not: a late worker meets both kinds of call."""
    import torch

    lib = cpu_ops.load()
    if lib is None or not cpu_ops.gemm_available():
        pytest.skip("the team runs the AVX-512 / AVX2 kernels")
    path, vocab = models["llama-i96"]
    want, _, _ = _run(monkeypatch, path, vocab, False)
    threads = torch.get_num_threads()
    try:
        for n in (2, 3):
            torch.set_num_threads(n)
            lib.team_set_worker_delay_us(delay_us)
            got, calls, _ = _run(monkeypatch, path, vocab, True)
            lib.team_set_worker_delay_us(0)
            assert calls["n"] > 0 and calls["rows"] > 32 and got == want, n
    finally:
        lib.team_set_worker_delay_us(0)
        torch.set_num_threads(threads)


def test_where_the_driver_does_not_run_the_loop_serves(models, monkeypatch):
    path, vocab = models["llama"]
    _, calls, llm = _run(monkeypatch, path, vocab, True, block_size=32)  # the C decode kernel's generic path
    assert calls["n"] == 0 and llm.engine.runner.model._stack is None
    path, vocab = models["qwen3"]
    want, _, _ = _run(monkeypatch, path, vocab, False)
    got, calls, llm = _run(monkeypatch, path, vocab, True)
    assert calls["n"] == 0 and got == want
    assert fused_stack.blocker(llm.engine.runner.model) == "qwen3's layers have parts the driver does not run"


def test_blocker_names_what_stands_in_the_way(models, monkeypatch):
    path, _ = models["llama"]
    llm = LLM(model=str(path), dtype="float64", num_kv_blocks=64)
    assert fused_stack.blocker(llm.engine.runner.model) == "float32 on CPU only"
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, cpu_linear="torch")
    assert fused_stack.blocker(llm.engine.runner.model) == "the projections are not the C GEMM's packed weights"
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64, fused_cpu_ops=False)
    assert fused_stack.blocker(llm.engine.runner.model) == "the C elementwise kernels are off"
    monkeypatch.setenv("PREFIXKV_FUSED_STACK", "0")
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    assert fused_stack.blocker(llm.engine.runner.model) == "PREFIXKV_FUSED_STACK=0"
    monkeypatch.delenv("PREFIXKV_FUSED_STACK")
    if gemm_available():  # more layers than the C call takes (its team's phases)
        monkeypatch.setattr(cpu_ops.load(), "decoder_layers_max", lambda: 1)
        model = llm.engine.runner.model
        assert fused_stack.blocker(model) == f"{model.shape.num_layers} layers (the C call takes 1)"
