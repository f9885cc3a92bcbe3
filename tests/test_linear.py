"""The decoder's GEMMs on packed weights (CPU float32: the C kernel and oneDNN) against the plain
F.linear path, fused projections against separate ones, batch independence of rows, and which
backend runs where."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixkv import cpu_ops
from prefixkv.model import linear as linear_mod
from prefixkv.model.linear import FusedLinear, Linear, onednn_available, resolve_cpu_linear

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
needs_c_gemm = pytest.mark.skipif(not cpu_ops.gemm_available(), reason="C kernels built without AVX-512 or AVX2")
KINDS = [pytest.param("c", marks=needs_c_gemm), pytest.param("onednn", marks=needs_onednn)]


def _linear(n_in: int, n_out: int, bias: bool, seed: int, dtype=torch.float32) -> Linear:
    g = torch.Generator().manual_seed(seed)
    m = Linear(n_in, n_out, bias)
    m.weight = torch.nn.Parameter(torch.randn(n_out, n_in, generator=g, dtype=dtype) * 0.05, requires_grad=False)
    if bias:
        m.bias = torch.nn.Parameter(torch.randn(n_out, generator=g, dtype=dtype), requires_grad=False)
    return m


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (96, 49152 // 16), (7, 50), (33, 1)])
def test_prepacked_linear_matches_f_linear(kind, n_in, n_out, bias):
    """float32 rounding apart, the same values as F.linear (the plain path, MKL); both within
    float32 rounding of the float64 product. Shapes include N not a multiple of the panel width."""
    m = _linear(n_in, n_out, bias, seed=n_in + n_out)
    w, b = m.weight.clone(), None if m.bias is None else m.bias.clone()
    x = torch.randn(130, n_in, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, w, b)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    m.prepack(kind)
    assert m.weight is None and m.packed is not None and m.kind == kind
    out = m(x)
    assert out.shape == (130, n_out) and out.dtype == torch.float32
    diff, err, ref_err = ((out - ref).abs().max().item(), (out.double() - exact).abs().max().item(),
                          (ref.double() - exact).abs().max().item())
    print(f"{kind} vs F.linear {n_in}->{n_out} bias={bias}: max abs diff {diff:.3e}; "
          f"vs float64 {err:.3e} (F.linear's {ref_err:.3e})")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert err <= 4 * ref_err + 1e-6
    if kind == "c":  # the two-level sum: within 1.5x of MKL's error (one chain over K was 3-5x)
        assert err <= 1.5 * ref_err + 1e-7, (err, ref_err)


@needs_c_gemm
def test_c_gemm_takes_strided_rows_and_empty_batches():
    m = _linear(64, 100, True, seed=3)
    w, b = m.weight.clone(), m.bias.clone()
    m.prepack("c")
    big = torch.randn(10, 3 * 64, generator=torch.Generator().manual_seed(4))
    x = big[:, 64:128]  # rows 192 apart
    assert x.stride() == (192, 1)
    assert torch.equal(m(x), m(x.contiguous()))
    torch.testing.assert_close(m(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert m(torch.empty(0, 64)).shape == (0, 100)


@needs_c_gemm
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (576, 3072), (64, 49)])
def test_c_gemm_rows_do_not_depend_on_the_batch_or_threads(n_in, n_out):
    """The C kernel: a row's output is bitwise the same whatever the number of rows in the call
    (1 included), where in the call it sits, and how many threads run it."""
    m = _linear(n_in, n_out, True, seed=7)
    m.prepack("c")
    x = torch.randn(300, n_in, generator=torch.Generator().manual_seed(2))
    full = m(x)
    for start, rows in ((0, 1), (5, 1), (0, 2), (0, 7), (1, 8), (3, 9), (0, 16), (40, 17), (100, 129), (0, 300)):
        assert torch.equal(m(x[start:start + rows]), full[start:start + rows]), (start, rows)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):  # (whatever the worker's default: pytest-xdist runs one thread each)
            torch.set_num_threads(n)
            assert torch.equal(m(x), full), n
    finally:
        torch.set_num_threads(threads)


@needs_c_gemm
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_in,n_out", [(576, 49152 // 8), (64, 97), (128, 48 * 5)])
def test_lm_head_argmax_is_argmax_of_the_written_logits(n_in, n_out, bias):
    """cpu_ops.lm_head_argmax (greedy decoding's norm + LM head + argmax in one call, the logits
    never written) gives each row torch.argmax of the logits the norm and the C GEMM return: ties
    (duplicated weight rows, in one panel of 48 columns and across panels and shares) go to the
    first index, a NaN logit wins (the first NaN), -inf rows give index 0; 1-3 threads, the GEMM in
    up to 32 shares (6,144 columns: 128 panels), with the team's workers joining at once, 0.3 ms or
    30 ms late (the caller's thread takes shares from the top of a worker's range; a share after a
    lower one of the same thread starts from its running maxima, one taken from the top does not)."""
    g = torch.Generator().manual_seed(n_out)
    m = _linear(n_in, n_out, bias, seed=n_out)
    w = m.weight.detach().clone()
    w[n_out - 3] = w[5]  # a tie across panels (and threads): argmax must be 5 where row 5 wins
    w[n_out // 2 + 1] = w[n_out // 2]  # a tie inside one panel
    tie2 = 200 if n_out > 400 else n_out - 3  # a tie across two shares of one thread (the second starts from the first's maxima)
    w[tie2] = w[5]
    # row 12's largest logit at 3100 and 3300 only: a worker's shares that the caller takes from the top
    # down (workers 30 ms late) must not start from a higher share's maxima
    tie3 = (3100, 3300) if n_out > 4000 else (n_out // 2, n_out // 2 + 1)
    w[tie3[1]] = w[tie3[0]]
    if bias:
        m.bias.data[n_out - 3] = m.bias.data[5]
        m.bias.data[tie2] = m.bias.data[5]
        m.bias.data[n_out // 2 + 1] = m.bias.data[n_out // 2]
        m.bias.data[tie3[1]] = m.bias.data[tie3[0]]
    m.weight = torch.nn.Parameter(w, requires_grad=False)
    norm_w = torch.rand(n_in, generator=g) + 0.5
    x, residual = torch.randn(40, n_in, generator=g), torch.randn(40, n_in, generator=g)
    x[3] = 0.0  # h = residual
    residual[7] = float("-inf")  # a row of NaN logits (inf / inf in the norm)
    # rows whose largest logit is a tied one: their normed input along the tied weight row
    unit = w[5] / norm_w
    x[10], residual[10] = 3.0 * unit, 0.0 * unit
    unit2 = w[n_out // 2] / norm_w
    x[11], residual[11] = 3.0 * unit2, 0.0 * unit2
    unit3 = w[tie3[0]] / norm_w
    x[12], residual[12] = 3.0 * unit3, 0.0 * unit3
    m.prepack("c")
    normed, _ = cpu_ops.add_rmsnorm(x, residual, norm_w, 1e-5)
    logits = m(normed)
    ref = logits.argmax(dim=-1)
    assert ref[10].item() == 5 and ref[11].item() == n_out // 2 and ref[7].item() == 0  # what the rows test
    assert ref[12].item() == tie3[0]
    threads, lib = torch.get_num_threads(), cpu_ops.load()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            for delay_us in (0, 300, 30_000):
                lib.team_set_worker_delay_us(delay_us)
                got = cpu_ops.lm_head_argmax(x, residual, norm_w, 1e-5, m.packed, n_out, m.bias)
                assert torch.equal(got, ref), (n, delay_us, (got != ref).nonzero())
    finally:
        lib.team_set_worker_delay_us(0)
        torch.set_num_threads(threads)
    nan_w = w.clone()
    nan_w[n_out - 2] = float("nan")  # two NaN columns: every row's argmax is the first (row 7: all NaN, 0)
    nan_w[n_out - 10] = float("nan")
    m2 = _linear(n_in, n_out, bias, seed=n_out)
    m2.weight = torch.nn.Parameter(nan_w, requires_grad=False)
    m2.prepack("c")
    ref2 = m2(normed).argmax(dim=-1)
    assert ref2[7].item() == 0 and (ref2[torch.arange(40) != 7] == n_out - 10).all()
    assert torch.equal(cpu_ops.lm_head_argmax(x, residual, norm_w, 1e-5, m2.packed, n_out, m2.bias), ref2)


@needs_onednn
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (1536, 576), (576, 3072)])
def test_onednn_rows_do_not_depend_on_the_batch(n_in, n_out):
    """Measured on this machine's oneDNN: from 2 rows up, a row's output is bitwise the same
    whatever the number of rows in the call. A single row with K = 1536 takes another kernel (it
    differs in the last bit), so M = 1 is left out."""
    m = _linear(n_in, n_out, False, seed=7)
    m.prepack("onednn")
    x = torch.randn(512, n_in, generator=torch.Generator().manual_seed(2))
    full = m(x)
    for rows in (2, 3, 7, 16, 17, 64, 129, 300):
        assert torch.equal(m(x[:rows]), full[:rows]), rows
    assert torch.equal(m(x[100:117]), full[100:117])


@pytest.mark.parametrize("kind", [None, *KINDS])
@pytest.mark.parametrize("bias", [False, True])
def test_fused_projections_equal_separate_ones_bitwise(kind, bias):
    """q/k/v (and gate/up) as one GEMM: every column is the same dot product as in its own GEMM."""
    parts = [_linear(576, n, bias, seed=i) for i, n in enumerate((576, 192, 192))]
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(3))
    fused = FusedLinear.from_parts(parts)
    assert fused.part_sizes == [576, 192, 192]
    if kind is not None:
        for p in parts:
            p.prepack(kind)
        fused.prepack(kind)
    for got, part in zip(fused(x), parts):
        assert torch.equal(got, part(x))


def test_float64_keeps_f_linear():
    """The exact (float64) lossless matrix runs the plain path: F.linear, bit for bit."""
    m = _linear(64, 48, True, seed=5, dtype=torch.float64)
    x = torch.randn(9, 64, dtype=torch.float64)
    assert torch.equal(m(x), F.linear(x, m.weight, m.bias))


def test_resolve_cpu_linear(monkeypatch):
    assert resolve_cpu_linear("torch") == "torch"
    monkeypatch.setattr(linear_mod.cpu_ops, "gemm_available", lambda: True)
    monkeypatch.setattr(linear_mod, "onednn_available", lambda: True)
    assert resolve_cpu_linear("auto") == "c"
    assert resolve_cpu_linear("onednn") == "onednn"
    monkeypatch.setattr(linear_mod.cpu_ops, "gemm_available", lambda: False)
    assert resolve_cpu_linear("auto") == "onednn"
    with pytest.raises(ValueError, match=r"^cpu_linear: 'c' is not available on this machine"):
        resolve_cpu_linear("c")
    monkeypatch.setattr(linear_mod, "onednn_available", lambda: False)
    assert resolve_cpu_linear("auto") == "torch"
    with pytest.raises(ValueError, match=r"^cpu_linear: must be one of"):
        resolve_cpu_linear("mkl")


def test_engine_config_refuses_an_unknown_cpu_linear():
    from prefixkv.config import EngineConfig

    with pytest.raises(ValueError, match=r"^cpu_linear: must be one of"):
        EngineConfig(cpu_linear="mkl")


def _tiny_model(path, dtype: str, cpu_linear: str):
    from prefixkv.model.loader import load_model

    return load_model(path, dtype, "cpu", cpu_linear=cpu_linear)[0]


@pytest.mark.parametrize("kind", KINDS)
def test_model_prepacks_only_cpu_float32(tiny_llama, kind):
    m32 = _tiny_model(tiny_llama, "float32", kind)
    lin = [m for m in m32.modules() if isinstance(m, Linear)]
    assert lin and all(m.packed is not None and m.weight is None and m.kind == kind for m in lin)
    assert m32.packed_lm_head is not None and not hasattr(m32, "lm_head")
    plain = _tiny_model(tiny_llama, "float32", "torch")
    assert all(m.packed is None for m in plain.modules() if isinstance(m, Linear)) and plain.packed_lm_head is None
    m64 = _tiny_model(tiny_llama, "float64", kind)
    assert all(m.packed is None for m in m64.modules() if isinstance(m, Linear)) and m64.packed_lm_head is None
    # fused projections either way: one GEMM for q/k/v and one for gate/up per layer
    layer = m64.model.layers[0]
    assert hasattr(layer.self_attn, "qkv_proj") and not hasattr(layer.self_attn, "q_proj")
    assert hasattr(layer.mlp, "gate_up_proj") and not hasattr(layer.mlp, "up_proj")


@needs_c_gemm
def test_auto_picks_the_c_gemm(tiny_llama):
    m = _tiny_model(tiny_llama, "float32", "auto")
    assert {x.kind for x in m.modules() if isinstance(x, Linear)} == {"c"}


@pytest.mark.parametrize("kind", KINDS)
def test_prepacked_model_logits_close_to_plain_and_same_greedy_tokens(tiny_llama, tiny_qwen2, kind):
    """The whole float32 forward on packed GEMMs against the plain path: logits within float32
    rounding (max abs diff printed) and the same greedy tokens from the engine. Qwen2 has biases."""
    from prefixkv import LLM, SamplingParams

    prompts = [[5 + (i * 7 + k) % 300 for i in range(20 + 9 * k)] for k in range(4)]
    for path in (tiny_llama, tiny_qwen2):
        outs = {}
        for cl in ("torch", kind):
            llm = LLM(model=str(path), cpu_linear=cl, block_size=4, num_kv_blocks=256)
            res = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True))
            outs[cl] = [(o.outputs[0].token_ids, o.outputs[0].token_logprobs) for o in res]
        diff = 0.0
        for (ta, la), (tb, lb) in zip(outs["torch"], outs[kind]):
            assert ta == tb
            diff = max(diff, max(abs(a.logprob - b.logprob) for a, b in zip(la, lb)))
        print(f"{path.name}: max abs diff of chosen logprobs, {kind} vs F.linear: {diff:.3e}")
        assert diff < 1e-4


@needs_c_gemm
def test_engine_takes_greedy_tokens_from_the_c_head_only_where_sampling_is_the_argmax(tiny_llama, tiny_qwen2,
                                                                                    monkeypatch):
    """A step whose every sampled token is greedy with nothing else asked (no logprobs, penalties,
    masks) takes its tokens from cpu_ops.lm_head_argmax (no logits), a prefill step's last prompt
    rows and the decodes beside them included; the tokens are those of the logits path (the same
    model with it off), Qwen2's LM head included; a request with logprobs, or one sampling, in the
    batch sends the step through the logits."""
    from prefixkv import LLM, SamplingParams
    from prefixkv.model.llama import LlamaModel
    from prefixkv.runner import model_runner

    calls = []
    real = cpu_ops.lm_head_argmax
    monkeypatch.setattr(cpu_ops, "lm_head_argmax", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    prompts = [[5 + (i * 7 + k) % 300 for i in range(20 + 9 * k)] for k in range(4)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for path in (tiny_llama, tiny_qwen2):
        # all four prompts in the first step (no admission cap), then 11 decode steps
        llm = LLM(model=str(path), block_size=4, num_kv_blocks=256, max_admitted_prefill_tokens=None)
        assert llm.engine.runner.model.greedy_head_ok
        calls.clear()
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        if path == tiny_llama:
            fused_llama = fused
        assert calls == [4] * 12  # the prefill step (its 4 last prompt rows of 134), then the 11 decode steps
        with monkeypatch.context() as mp:
            mp.setattr(LlamaModel, "greedy_head_ok", property(lambda self: False))
            assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == fused
        calls.clear()
        mixed = [greedy] * 3 + [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, mixed)] == fused and calls == []
        calls.clear()
        mixed = [greedy] * 3 + [SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, mixed)][:3] == fused[:3] and calls == []
    # prompts in chunks of a 16-token budget beside the decodes of the others: every step through the
    # C head (the sampler never called), the tokens of the logits path
    sampled, steps_greedy = [], []
    real_sample, real_forward = model_runner.sample, LlamaModel.forward
    monkeypatch.setattr(model_runner, "sample", lambda *a, **k: sampled.append(a[0].shape[0]) or real_sample(*a, **k))

    def forward(self, input_ids, *a, greedy=False, **k):  # (tokens of the step, rows of logits) of the C head's
        if greedy:
            steps_greedy.append((input_ids.shape[0], None if a[4] is None else a[4].shape[0]))
        return real_forward(self, input_ids, *a, greedy=greedy, **k)
    monkeypatch.setattr(LlamaModel, "forward", forward)
    for head_ok in (True, False):
        with monkeypatch.context() as mp:
            if not head_ok:
                mp.setattr(LlamaModel, "greedy_head_ok", property(lambda self: False))
            chunked = LLM(model=str(tiny_llama), block_size=4, num_kv_blocks=256, max_num_batched_tokens=16)
            calls.clear(), sampled.clear(), steps_greedy.clear()
            assert [o.outputs[0].token_ids for o in chunked.generate(prompts, greedy)] == fused_llama
            steps = chunked.engine.num_steps
            if head_ok:  # one call a step but the steps that only computed prompt chunks
                assert sampled == [] and 0 < len(calls) < steps and sum(calls) == 4 * 12
                # steps that finished a prompt beside decodes: more tokens than rows, more than one row
                assert any(rows is not None and 1 < rows < t for t, rows in steps_greedy)
            else:
                assert calls == [] and sum(sampled) == 4 * 12
    with monkeypatch.context() as mp:  # the C scratch not allocated: the same tokens through logits
        mp.setattr(cpu_ops, "lm_head_argmax", lambda *a, **k: calls.append(-1) and None)
        calls.clear()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == fused and -1 in calls
    # n-gram drafts: a verifying step's rows are every token, each its argmax (the accepted prefix)
    llm = LLM(model=str(tiny_llama), block_size=4, num_kv_blocks=256, num_speculative_tokens=3)
    repetitive = [[7, 8, 9, 10] * 6, [11, 12, 13] * 9]
    calls.clear()
    spec = [o.outputs[0].token_ids for o in llm.generate(repetitive, greedy)]
    assert calls and max(calls) > 2  # drafts verified through the C head
    with monkeypatch.context() as mp:
        mp.setattr(LlamaModel, "greedy_head_ok", property(lambda self: False))
        assert [o.outputs[0].token_ids for o in llm.generate(repetitive, greedy)] == spec
